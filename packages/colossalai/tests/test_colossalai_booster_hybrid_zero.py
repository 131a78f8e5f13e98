"""HybridParallelPlugin with ``zero_stage`` 1/2: ``colossal.zero`` shards optimizer states (and
gradients) over the dp (x sp) axis in place of DDP. Parity with plain single-process PyTorch,
clipping (by the dense norm, also under tensor parallelism: one SGD step after the clip equals
``torch.nn.utils.clip_grad_norm_`` + SGD on the dense model) and checkpoints to and from other plugins.

Tolerance: fp32, 1e-5 relative per-step loss (see test_colossalai_booster_hybrid.py; ZeRO only
changes where the AdamW update of each element is computed).
"""

import math

import pytest
import torch
from colossalai_harness import (
    GLOBAL_BATCH,
    SEQ,
    TOTAL,
    boosted_losses,
    boosted_setup,
    criterion,
    dataset,
    make_model_and_optim,
    reference_losses,
    resume_and_train,
    train_and_save,
)

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer
from colossalai import Booster, HybridParallelPlugin, TorchDDPPlugin
from colossalai.models import build_gpt

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
    booster.clip_grad_norm(optim, 1e-3)
    optim.step()
    return optim.unwrap().last_grad_norm.item()


def test_hybrid_zero_clips_by_the_dense_norm_without_tp():
    torch.manual_seed(0)
    model, _ = make_model_and_optim()
    _, _, _, loader = boosted_setup(TorchDDPPlugin())
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for norm in run_distributed(_clip, 4, dict(tp_size=1, sp_size=2, zero_stage=2), timeout=120):
        assert norm == pytest.approx(ref, rel=1e-5)


SGD_LR = 1.0  # plain SGD: the update is proportional to the clipped gradient (Adam would hide the scale)


def _dense_clip_step(norm_type: float, clip_at: float | None):
    """One full-batch step of the dense model; ``clip_at``: fraction of the norm to clip to."""
    _, _, _, loader = boosted_setup(TorchDDPPlugin())  # one process: the first global batch
    x, y = next(iter(loader))
    model = build_gpt("tiny", seed=0, block_size=SEQ)
    criterion(model(x), y).backward()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type).item()
    if clip_at is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_at * total, norm_type)
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    return total, model.state_dict()


def _hybrid_clip_step(kwargs, max_norm: float, norm_type: float):
    torch.manual_seed(0)
    plugin = HybridParallelPlugin(**kwargs)
    booster = Booster(plugin=plugin)
    model = build_gpt("tiny", seed=0, block_size=SEQ)
    optim = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
    model, optim, _, loader, _ = booster.boost(model, optim, criterion, loader)
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    returned = booster.clip_grad_norm(optim, max_norm, norm_type).item()
    optim.step()
    assert returned == pytest.approx(optim.unwrap().last_grad_norm.item(), rel=1e-5)  # the norm before clipping
    return returned, plugin.full_model_state_dict(model.module)


TP_CLIP = [
    (4, dict(tp_size=2, zero_stage=2), 2.0),
    (4, dict(tp_size=2, zero_stage=2), math.inf),
    (4, dict(tp_size=2, sp_size=2, zero_stage=1), 2.0),
    (4, dict(tp_size=4, tp_mode="2d", zero_stage=1), 2.0),
    (8, dict(tp_size=8, tp_mode="2.5d", tp_depth=2, zero_stage=1), 2.0),
]


@pytest.mark.parametrize(
    "world,kwargs,norm_type",
    TP_CLIP,
    ids=["dp2xtp2-zero2-l2", "dp2xtp2-zero2-inf", "sp2xtp2-zero1-l2", "2d-tp4-zero1-l2", "2.5d-tp8-d2-zero1-l2"],
)
def test_hybrid_zero_clips_by_the_dense_norm_under_tp(world, kwargs, norm_type):
    """Each element counts once: tp-sharded (1D splits, 2D blocks), tp-replicated (1D LayerNorms,
    position embedding, row biases), held by part of the tp group (the 2.5D depth) and dp-sharded
    by ZeRO. Tolerance: the norm 1e-5 relative (fp32
    reduction order); parameters after the step 1e-5 relative + 1e-6 absolute."""
    total, _ = _dense_clip_step(norm_type, None)
    _, expected = _dense_clip_step(norm_type, 0.5)
    for norm, state in run_distributed(_hybrid_clip_step, world, kwargs, 0.5 * total, norm_type, timeout=180):
        assert norm == pytest.approx(total, rel=1e-5)
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


MATRIX = [
    ((4, dict(tp_size=2, zero_stage=2)), (1, {})),
    ((2, {}), (4, dict(tp_size=1, sp_size=2, zero_stage=1))),
    ((8, dict(tp_size=4, tp_mode="2d", zero_stage=1)), (2, {})),
]
IDS = ["dp2xtp2-zero2-to-ddp1", "ddp2-to-dp2xsp2-zero1", "dp2x2d4-zero1-to-ddp2"]


@pytest.mark.parametrize("save,load", MATRIX, ids=IDS)
def test_hybrid_zero_resume_across_plugins(tmp_path, save, load):
    before = run_distributed(train_and_save, save[0], save[1], str(tmp_path), timeout=120)[0]
    after = run_distributed(resume_and_train, load[0], load[1], str(tmp_path), timeout=120)[0]
    torch.testing.assert_close(torch.tensor(before + after), torch.tensor(reference_losses(TOTAL)), rtol=1e-5, atol=0)
