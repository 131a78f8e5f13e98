"""Booster + TorchDDPPlugin against plain single-process PyTorch.

Tolerance: fp32, per-step mean loss within 1e-5 relative of the reference. The only difference
is the order of floating-point reductions (DDP averages gradients of two half-batches instead of
one backward over the whole batch), which perturbs the loss at the 1e-7 level per step and
grows slowly with Adam over a few steps.
"""

import pytest
import torch
from colossalai_harness import GLOBAL_BATCH, boosted_losses, boosted_setup, criterion, reference_losses

from colossal.comm.testing import run_distributed
from colossalai import Booster, TorchDDPPlugin

STEPS = 4


def _ddp_losses(lazy: bool = False):
    booster, model, optim, loader = boosted_setup(TorchDDPPlugin(), lazy=lazy)
    return boosted_losses(booster, model, optim, loader, STEPS)


@pytest.mark.parametrize("world", [1, 2])
def test_ddp_matches_plain_pytorch(world):
    ref = reference_losses(STEPS)
    got = run_distributed(_ddp_losses, world, timeout=120)[0] if world > 1 else _ddp_losses()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    assert got[-1] < got[0]


def test_meta_model_is_materialised_and_optimizer_rebound():
    booster, model, optim, _ = boosted_setup(TorchDDPPlugin(), lazy=True)
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for g in optim.param_groups for p in g["params"])
    assert not any(p.is_meta for p in model.parameters())


class _Tied(torch.nn.Module):
    """A user's own model with tied input/output embeddings and a tied buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(12, 6)
        self.head = torch.nn.Linear(6, 12, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.ones(6))
        self.inner = torch.nn.Module()
        self.inner.register_buffer("mask", self.mask)

    def reset_parameters(self):
        """The model's own initialiser of its buffer (a meta buffer keeps no values)."""
        self.mask.fill_(1.0)

    def forward(self, x):
        return self.head(self.emb(x) * self.inner.mask)


class _NoInit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("causal", torch.ones(3, 3).tril().bool())
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.gain = torch.nn.Parameter(torch.ones(3))


def test_meta_model_with_uninitialised_tensors_is_refused_by_name():
    """Nothing re-creates a meta model's ``torch.ones`` buffers or bare Parameters: naming them
    beats training on the garbage ``to_empty`` leaves (NaN here, any value on another run)."""
    with torch.device("meta"):
        model = _NoInit()
    with pytest.raises(ValueError, match="gain, causal, scale, steps not initialised") as err:
        Booster(plugin=TorchDDPPlugin()).boost(model)
    assert "lin." not in str(err.value)


def test_meta_model_keeps_its_ties():
    """``to_empty`` gives each module its own new Parameter; materialisation must re-tie them (one
    Parameter, one optimizer entry, trained like the same model built on the CPU)."""
    with torch.device("meta"):
        model = _Tied()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    boosted, optim, *_ = Booster(plugin=TorchDDPPlugin()).boost(model, optim)
    model = boosted.unwrap()
    assert model.head.weight is model.emb.weight and model.inner.mask is model.mask
    assert not any(t.is_meta for t in model.state_dict().values())
    assert [p for g in optim.param_groups for p in g["params"]] == [model.emb.weight]
    ref = _Tied()
    ref.load_state_dict(model.state_dict())
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.tensor([[1, 2, 3]])
    for m, o in ((model, optim), (ref, ref_optim)):
        m(x).square().mean().backward()
        o.step()
    torch.testing.assert_close(model.emb.weight, ref.emb.weight, rtol=0, atol=0)


def _accumulate():
    """Two micro-batches under no_sync + one synced equals one big batch."""
    booster, model, optim, loader = boosted_setup(TorchDDPPlugin())
    x, y = next(iter(loader))
    halves = [(x[: len(x) // 2], y[: len(y) // 2]), (x[len(x) // 2 :], y[len(y) // 2 :])]
    with booster.no_sync(model, optim):
        booster.backward(criterion(model(halves[0][0]), halves[0][1]) / 2, optim)
    booster.backward(criterion(model(halves[1][0]), halves[1][1]) / 2, optim)
    accumulated = [p.grad.clone() for p in model.parameters()]
    optim.zero_grad()
    booster.backward(criterion(model(x), y), optim)
    return [torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7) for a, p in zip(accumulated, model.parameters())]


def test_no_sync_accumulation_equals_full_batch():
    assert all(all(r) for r in run_distributed(_accumulate, 2, timeout=120))


def test_clip_grad_norm_matches_torch():
    booster, model, optim, loader = boosted_setup(TorchDDPPlugin())
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    ref = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = booster.clip_grad_norm(optim, 0.01)
    torch.testing.assert_close(norm, ref)
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(after, torch.tensor(0.01), rtol=1e-4, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_tracks_fp32(precision):
    booster, model, optim, loader = boosted_setup(TorchDDPPlugin(), precision=precision)
    got = boosted_losses(booster, model, optim, loader, STEPS)
    ref = reference_losses(STEPS)
    # Low-precision forward: losses agree with fp32 to about 1e-2 relative on this tiny model.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=3e-2, atol=0)
    if precision == "fp16":
        assert optim.scaler.scale > 1.0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="mixed_precision"):
        Booster(mixed_precision="fp8")
    with pytest.raises(TypeError, match="plugin"):
        Booster(plugin="ddp")
    with pytest.raises(ValueError, match="batch_size"):
        Booster().prepare_dataloader(list(range(10)), 0)
    assert GLOBAL_BATCH % 2 == 0
