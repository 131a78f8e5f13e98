"""The wrapped model's own ``state_dict()`` / ``load_state_dict()`` (issue 31 item 3; ``[Note: the wrapped
model's own state dict]`` in ``module_state.py``). Stage 3 used to return empty placeholders (``torch.save``
wrote a 2.9 KB file that ``torch.load`` could not read back into a model); a load into the parameters was
overwritten by the next step. Now, on 2 ranks and every stage: what ``model.state_dict()`` gives, saved with
``torch.save``, loads into the plain model and equals the engine's full state; ``model.load_state_dict`` of a
plain model's state makes the next step plain PyTorch's (fp32, 1e-5 relative: reduction order); torch's
strict errors; a nested model; a stage-3 submodule's ``state_dict()`` refuses, naming the call to use."""

import io

import pytest
import torch
import torch.distributed as dist
from colossal_zero_testutil import global_batch, loss_of, make_model, make_optimizer

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer


def _step(model, zero, step):
    x, y = global_batch(step, 4)  # every rank the same batch: the run is the single-process run
    loss = loss_of(model, x, y)
    zero.backward(loss)
    zero.step()
    zero.zero_grad()
    return loss.item()


def _plain_step(model, opt, step):
    x, y = global_batch(step, 4)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _case(stage: int, offload: bool) -> list[str]:
    wrong = []
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model), model, stage=stage, offload=offload)
    _step(model, zero, 0)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # what a user does
    plain = make_model(seed=5)
    plain.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    full = zero.full_model_state_dict()
    far = [k for k, v in plain.state_dict().items() if not torch.equal(v, full[k])]
    if far:
        wrong.append(f"saved state differs from the engine's full state: {far}")
    # a plain model's state loaded through model.load_state_dict drives the next step
    ref, ref_opt = make_model(seed=9), None
    ref_opt = make_optimizer(ref)
    _plain_step(ref, ref_opt, 0)
    fresh = make_model(seed=3)
    fresh_zero = ZeroOptimizer(make_optimizer(fresh), fresh, stage=stage, offload=offload)
    result = fresh.load_state_dict(ref.state_dict())
    if result.missing_keys or result.unexpected_keys:
        wrong.append(f"a full load reported {result}")
    fresh_zero.load_state_dict(ref_opt.state_dict())
    got, want = _step(fresh, fresh_zero, 1), _plain_step(ref, ref_opt, 1)
    if abs(got - want) > 1e-5 * abs(want):
        wrong.append(f"after model.load_state_dict: loss {got}, plain PyTorch {want}")
    after = fresh.state_dict()
    far = [k for k, v in ref.state_dict().items() if not torch.allclose(after[k], v, rtol=1e-5, atol=1e-6)]
    if far:
        wrong.append(f"after model.load_state_dict + a step: parameters differ from plain PyTorch: {far}")
    # torch's strict errors, raised on every rank before anything changes
    sd = ref.state_dict()
    name = next(iter(sd))
    try:
        fresh.load_state_dict({k: v for k, v in sd.items() if k != name} | {"stray": torch.zeros(1)})
        wrong.append("a strict load with a missing and an unexpected key passed")
    except RuntimeError as e:
        if name not in str(e) or "stray" not in str(e):
            wrong.append(f"strict error does not name both keys: {e}")
    non_strict = fresh.load_state_dict({k: v for k, v in sd.items() if k != name}, strict=False)
    if non_strict.missing_keys != [name]:
        wrong.append(f"strict=False reported missing {non_strict.missing_keys}, want [{name!r}]")
    # nested in a parent: the prefix is honoured both ways
    parent = torch.nn.ModuleDict({"lm": fresh})
    nested = parent.state_dict()
    if not all(torch.equal(nested[f"lm.{k}"], v) for k, v in fresh.state_dict().items()):
        wrong.append("parent.state_dict() differs from the model's")
    parent.load_state_dict(nested)
    if stage == 3:
        try:
            fresh.blocks[0].state_dict()
            wrong.append("a stage-3 submodule's state_dict() returned placeholders")
        except RuntimeError as e:
            if "whole model's state_dict()" not in str(e):
                wrong.append(f"submodule refusal does not say what to call: {e}")
    return wrong


def cases(layouts):
    return {layout: _case(*layout) for layout in layouts} | {"rank": dist.get_rank()}


@pytest.mark.parametrize("layouts", [((1, False), (3, False)), ((2, True),)], ids=["stage1-stage3", "stage2-offload"])
def test_the_wrapped_models_own_state_dict_is_full_and_loadable(layouts):
    """(stage, offload): with offload the fp32 masters are copies, so a load into the parameters alone
    would be lost at the next step."""
    for result in run_distributed(cases, 2, layouts, timeout=180):
        wrong = [f"rank {result['rank']} stage {s} offload {o}: {w}" for s, o in layouts for w in result[s, o]]
        assert not wrong, "\n".join(wrong)
