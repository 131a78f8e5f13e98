"""HybridParallelPlugin with ``zero_stage`` 1/2: ``colossal.zero`` shards optimizer states (and
gradients) over the dp (x sp) axis in place of DDP. Parity with plain single-process PyTorch,
clipping (sequence/data parallel) and checkpoints to and from other plugins.

Tolerance: fp32, 1e-5 relative per-step loss (see test_colossalai_booster_hybrid.py; ZeRO only
changes where the AdamW update of each element is computed).
"""

import pytest
import torch
from colossalai_harness import (
    GLOBAL_BATCH,
    boosted_losses,
    boosted_setup,
    criterion,
    make_model_and_optim,
    reference_losses,
)

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer
from colossalai import HybridParallelPlugin, RunState, TorchDDPPlugin

STEPS = 3
LAYOUTS = [
    (4, dict(tp_size=2, zero_stage=2)),
    (4, dict(tp_size=1, sp_size=2, zero_stage=1)),
    (8, dict(tp_size=4, tp_mode="2d", zero_stage=1)),
]


def _losses(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    assert isinstance(optim.unwrap(), ZeroOptimizer)
    return boosted_losses(booster, model, optim, loader, STEPS)


@pytest.mark.parametrize("world,kwargs", LAYOUTS, ids=["dp2xtp2-zero2", "dp2xsp2-zero1", "dp2x2d4-zero1"])
def test_hybrid_zero_matches_plain_pytorch(world, kwargs):
    ref = torch.tensor(reference_losses(STEPS))
    for rank_losses in run_distributed(_losses, world, kwargs, timeout=180):
        torch.testing.assert_close(torch.tensor(rank_losses), ref, rtol=1e-5, atol=0)


def _clip(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    if kwargs["tp_size"] > 1:
        with pytest.raises(NotImplementedError, match="tp_size=1"):
            booster.clip_grad_norm(optim, 1e-3)
        return None
    booster.clip_grad_norm(optim, 1e-3)
    optim.step()
    return optim.unwrap().last_grad_norm.item()


def test_hybrid_zero_clips_by_the_dense_norm_and_refuses_under_tp():
    torch.manual_seed(0)
    model, _ = make_model_and_optim()
    _, _, _, loader = boosted_setup(TorchDDPPlugin())
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for norm in run_distributed(_clip, 4, dict(tp_size=1, sp_size=2, zero_stage=2), timeout=120):
        assert norm == pytest.approx(ref, rel=1e-5)
    assert run_distributed(_clip, 2, dict(tp_size=2, zero_stage=1), timeout=120) == [None, None]


SAVE_AT, TOTAL = 2, 4


def _plugin(kwargs):
    return HybridParallelPlugin(**kwargs) if kwargs else TorchDDPPlugin()


def _train_and_save(kwargs, root):
    booster, model, optim, loader = boosted_setup(_plugin(kwargs))
    losses = boosted_losses(booster, model, optim, loader, SAVE_AT)
    booster.save_run(root, model, optim, state=RunState(step=SAVE_AT, consumed_samples=SAVE_AT * GLOBAL_BATCH))
    return losses


def _resume(kwargs, root):
    booster, model, optim, loader = boosted_setup(_plugin(kwargs))
    state = booster.load_run(root, model, optim, dataloader=loader)
    return boosted_losses(booster, model, optim, loader, TOTAL, start=state.step)


MATRIX = [
    ((4, dict(tp_size=2, zero_stage=2)), (1, {})),
    ((2, {}), (4, dict(tp_size=1, sp_size=2, zero_stage=1))),
    ((8, dict(tp_size=4, tp_mode="2d", zero_stage=1)), (2, {})),
]
IDS = ["dp2xtp2-zero2-to-ddp1", "ddp2-to-dp2xsp2-zero1", "dp2x2d4-zero1-to-ddp2"]


@pytest.mark.parametrize("save,load", MATRIX, ids=IDS)
def test_hybrid_zero_resume_across_plugins(tmp_path, save, load):
    before = run_distributed(_train_and_save, save[0], save[1], str(tmp_path), timeout=120)[0]
    after = run_distributed(_resume, load[0], load[1], str(tmp_path), timeout=120)[0]
    torch.testing.assert_close(torch.tensor(before + after), torch.tensor(reference_losses(TOTAL)), rtol=1e-5, atol=0)
