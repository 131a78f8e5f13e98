"""Every plugin saves, every other plugin loads, and the run goes on as if never interrupted.

The model has buffers, one of them 0-dim (BatchNorm's ``num_batches_tracked``), and BatchNorm with
``momentum=None`` (a cumulative average weighted by ``num_batches_tracked``), so a buffer left at
its initial value changes the running statistics of the next step and with them the eval-mode
loss. Every rank sees the same batch, so the data-parallel run is the single-process run (mean of
equal gradients) and the buffers agree on every rank. Reference: plain PyTorch, uninterrupted.
Tolerance: 1e-5 relative on losses and buffers (fp32; the engines' reduction order differs from
the single process by a few ulps).
"""

import pytest
import torch
from torch import nn

from colossal.comm.testing import run_distributed
from colossalai import Booster
from colossalai.booster.registry import make_plugin

SAVE_AT = 2
PLUGINS = {
    "ddp": {},
    "fsdp": {},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "gemini": {},
}


def _plugin(spec: str):
    return make_plugin("zero" if spec.startswith("zero") else spec, **PLUGINS[spec])


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def _step(model, x, y, booster, optim) -> float:
    """One training step; ``booster`` None: plain ``loss.backward()``."""
    model.train()
    loss = (model(x) - y).pow(2).mean()
    loss.backward() if booster is None else booster.backward(loss, optim)
    optim.step()
    optim.zero_grad()
    return loss.item()


def _eval_loss(model) -> float:
    model.eval()
    with torch.no_grad():
        x, y = _batch(99)
        out = (model(x) - y).pow(2).mean().item()
    model.train()
    return out


def reference() -> list[float]:
    """Plain PyTorch: train loss of step SAVE_AT (the one after the save) and the eval loss after it."""
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = [_step(model, *_batch(s), None, optim) for s in range(SAVE_AT + 1)]
    return [losses[-1], _eval_loss(model), float(model[1].num_batches_tracked)]


def _boost(spec: str, seed: int):
    booster = Booster(plugin=_plugin(spec))
    model = _model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optim, *_ = booster.boost(model, optim)
    return booster, model, optim


def _num_batches_tracked(booster, model) -> float:
    return float(booster.plugin.unwrap(model.module)[1].num_batches_tracked)


def save_all(root: str) -> None:
    for spec in PLUGINS:
        booster, model, optim = _boost(spec, 0)
        for s in range(SAVE_AT):
            _step(model, *_batch(s), booster, optim)
        booster.save_optimizer(optim, root, name=spec)


def load_all(root: str) -> dict:
    out = {}
    for saver in PLUGINS:
        for loader in PLUGINS:
            booster, model, optim = _boost(loader, 1)  # other weights: the load must replace them
            booster.load_optimizer(optim, f"{root}/{saver}")
            tracked = _num_batches_tracked(booster, model)
            loss = _step(model, *_batch(SAVE_AT), booster, optim)
            out[saver, loader] = [loss, _eval_loss(model), tracked + 1]
    return out


def test_every_plugin_loads_every_plugins_checkpoint(tmp_path):
    ref = torch.tensor(reference())
    run_distributed(save_all, 2, str(tmp_path), timeout=300)
    got = run_distributed(load_all, 2, str(tmp_path), timeout=400)
    wrong = []
    for pair, values in got[0].items():
        if not torch.allclose(torch.tensor(values), ref, rtol=1e-5, atol=1e-7):
            wrong.append(f"{pair[0]} -> {pair[1]}: {values} (uninterrupted: {ref.tolist()})")
    assert not wrong, "\n".join(wrong)


# -- the hybrid plugin applies its GPT plan to every model: its pairs run on the tiny GPT, with a
# 0-dim buffer counting forwards (a step counter the way users keep one) ---------------------------
HYBRID = {"hybrid": {"tp_size": 2}, **PLUGINS}
PAIRS = [("hybrid", p) for p in HYBRID if p != "hybrid"] + [(p, "hybrid") for p in HYBRID if p != "hybrid"]


def _count_forward(module, args) -> None:
    module.forwards.add_(1)


def _gpt_setup(spec: str):
    from colossalai_harness import GLOBAL_BATCH, criterion, dataset, make_model_and_optim

    torch.manual_seed(0)
    plugin = make_plugin("zero" if spec.startswith("zero") else spec, **HYBRID[spec])
    booster = Booster(plugin=plugin)
    model, optim = make_model_and_optim()
    model.register_buffer("forwards", torch.zeros((), dtype=torch.long))
    model.register_forward_pre_hook(_count_forward)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
    model, optim, _, loader, _ = booster.boost(model, optim, criterion, loader)
    return booster, model, optim, loader


def gpt_pair(saver: str, loader_spec: str, root: str):
    from colossalai_harness import GLOBAL_BATCH, boosted_losses

    from colossalai import RunState

    booster, model, optim, loader = _gpt_setup(saver)
    before = boosted_losses(booster, model, optim, loader, SAVE_AT)
    booster.save_run(root, model, optim, state=RunState(step=SAVE_AT, consumed_samples=SAVE_AT * GLOBAL_BATCH))
    booster, model, optim, loader = _gpt_setup(loader_spec)
    state = booster.load_run(root, model, optim, dataloader=loader)
    forwards = int(booster.plugin.unwrap(model.module).forwards)
    after = boosted_losses(booster, model, optim, loader, SAVE_AT + 1, start=state.step)
    return before + after, forwards


@pytest.mark.parametrize("saver,loader", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_hybrid_pairs_on_gpt_with_a_0dim_buffer(tmp_path, saver, loader):
    from colossalai_harness import reference_losses

    losses, forwards = run_distributed(gpt_pair, 2, saver, loader, str(tmp_path), timeout=240)[0]
    assert forwards == SAVE_AT, forwards
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses(SAVE_AT + 1)), rtol=1e-5, atol=0)
