"""Booster + HybridParallelPlugin against plain single-process PyTorch: data x tensor parallel
(1D, 2D, 2.5D, 3D), data x sequence parallel (ring, all-to-all attention), and tensor x sequence
parallel (1D, 2D); fp16.

Tolerance: fp32, 1e-5 relative per-step loss: tensor and sequence parallelism split matrix
products and attention and sum partial results over ranks (plus the dp gradient average),
changing only reduction order (measured: at most 2 ulp, ~2e-7, in every mode here).
"""

import math

import pytest
import torch
from colossalai_harness import boosted_losses, boosted_setup, criterion, make_model_and_optim, reference_losses

from colossal.comm.testing import run_distributed
from colossalai import Booster, HybridParallelPlugin, TorchDDPPlugin

STEPS = 3
LAYOUTS = [  # (world, plugin kwargs): every mode, with dp where the world allows it
    (2, dict(tp_size=2)),
    (4, dict(tp_size=2)),
    (4, dict(tp_size=4, tp_mode="2d")),
    (4, dict(tp_size=4, tp_mode="2.5d")),
    (8, dict(tp_size=8, tp_mode="2.5d", tp_depth=2)),
    (8, dict(tp_size=8, tp_mode="3d")),
    (2, dict(tp_size=1, sp_size=2)),
    (4, dict(tp_size=1, sp_size=2, sp_kind="all_to_all")),
    (4, dict(tp_size=2, sp_size=2)),
    (4, dict(tp_size=2, sp_size=2, sp_kind="all_to_all")),
    (8, dict(tp_size=4, tp_mode="2d", sp_size=2)),  # the smallest world for 2D x sp
]
IDS = [
    *["tp2", "dp2xtp2", "2d-tp4", "2.5d-tp4-d1", "2.5d-tp8-d2", "3d-tp8", "sp2-ring", "dp2xsp2-all_to_all"],
    *["sp2xtp2-ring", "sp2xtp2-all_to_all", "sp2x2d-tp4-ring"],
]


def _hybrid_losses(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    local = sum(p.numel() for p in booster.plugin.unwrap(model.module).parameters())
    return boosted_losses(booster, model, optim, loader, STEPS), local


@pytest.mark.parametrize("world,kwargs", LAYOUTS, ids=IDS)
def test_hybrid_matches_plain_pytorch(world, kwargs):
    got = run_distributed(_hybrid_losses, world, kwargs, timeout=180)
    ref = torch.tensor(reference_losses(STEPS))
    dense = sum(p.numel() for p in make_model_and_optim()[0].parameters())
    for rank_losses, local in got:
        torch.testing.assert_close(torch.tensor(rank_losses), ref, rtol=1e-5, atol=0)
        assert kwargs["tp_size"] == 1 or local < dense, (local, dense)
        if kwargs["tp_size"] > 2:  # really sharded: dense / (P / depth), up to rounding of the split
            assert local <= math.ceil(dense * kwargs.get("tp_depth", 1) / kwargs["tp_size"]) + 64, (local, dense)


def _clip_norm(kwargs, norm_type):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    before = booster.clip_grad_norm(optim, 1e-3, norm_type).item()
    after = booster.clip_grad_norm(optim, 1e9, norm_type).item()  # norm of the clipped gradients
    return before, after


CLIP = [
    (2, dict(tp_size=2)),
    (8, dict(tp_size=8, tp_mode="2.5d", tp_depth=2)),
    (4, dict(tp_size=1, sp_size=2)),
    (4, dict(tp_size=2, sp_size=2)),
]


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("world,kwargs", CLIP, ids=["1d-tp2", "2.5d-tp8-d2", "dp2xsp2", "sp2xtp2"])
def test_hybrid_clips_by_the_dense_gradient_norm(world, kwargs, norm_type):
    """Parameters replicated over part of the tp group (2.5D depth, 2D/2.5D position embedding,
    1D LayerNorms) or all of the sp group are counted once; the clip scales every gradient."""
    torch.manual_seed(0)
    model, _ = make_model_and_optim()
    _, _, _, loader = boosted_setup(TorchDDPPlugin())  # one process: the same first global batch
    x, y = next(iter(loader))
    dp = world // (kwargs["tp_size"] * kwargs.get("sp_size", 1))
    for xs, ys in zip(x.chunk(dp), y.chunk(dp)):  # DDP averages the dp shards' gradients
        (criterion(model(xs), ys) / dp).backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type).item()
    for before, after in run_distributed(_clip_norm, world, kwargs, norm_type, timeout=120):
        assert before == pytest.approx(ref, rel=1e-5)
        assert after == pytest.approx(1e-3, rel=1e-4)


def _fp16_losses(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs), precision="fp16")
    return boosted_losses(booster, model, optim, loader, STEPS), optim.scaler.scale


FP16 = [(2, dict(tp_size=2)), (4, dict(tp_size=2, sp_size=2)), (4, dict(tp_size=4, tp_mode="2d"))]


@pytest.mark.parametrize("world,kwargs", FP16, ids=["tp2", "sp2xtp2", "2d-tp4"])
def test_hybrid_fp16_trains_and_tracks_fp32(world, kwargs):
    """fp16 autocast with dynamic loss scaling: losses within 3e-2 relative of fp32 (the fp16
    forward's rounding on this tiny model, as for DDP), and the scale stays above 1."""
    ref = torch.tensor(reference_losses(STEPS))
    for losses, scale in run_distributed(_fp16_losses, world, kwargs, timeout=180):
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=3e-2, atol=0)
        assert scale > 1.0


def _overflow_on_one_rank(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs), precision="fp16")
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    param = next(booster.plugin.unwrap(model.module).parameters())
    if torch.distributed.get_rank() == 1:  # only this tp rank's block overflows
        param.grad.view(-1)[0] = float("inf")
    before = param.detach().clone()
    optim.step()
    return optim.last_step_skipped, optim.scaler.scale, torch.equal(param.detach(), before)


def test_hybrid_fp16_overflow_on_one_tp_rank_skips_on_every_rank():
    results = run_distributed(_overflow_on_one_rank, 2, dict(tp_size=2), timeout=120)
    assert all(skipped and unchanged for skipped, _, unchanged in results), results
    assert len({scale for _, scale, _ in results}) == 1, results


def test_hybrid_refuses_unsupported_layouts():
    with pytest.raises(NotImplementedError, match="tp_mode in"):
        HybridParallelPlugin(tp_mode="4d")
    with pytest.raises(NotImplementedError, match="zero_stage in"):
        HybridParallelPlugin(zero_stage=3)
    with pytest.raises(NotImplementedError, match=r"\['fp32', 'bf16'\], got fp16"):
        Booster(plugin=HybridParallelPlugin(tp_size=2, zero_stage=1), mixed_precision="fp16")
    with pytest.raises(ValueError, match="q\\^2"):
        HybridParallelPlugin(tp_size=2, tp_mode="2d")
    with pytest.raises(ValueError, match="q\\^3"):
        HybridParallelPlugin(tp_size=4, tp_mode="3d")
    with pytest.raises(ValueError, match="tp_depth"):
        HybridParallelPlugin(tp_size=4, tp_mode="2d", tp_depth=2)
    with pytest.raises(ValueError, match="sp_kind"):
        HybridParallelPlugin(tp_size=1, sp_size=2, sp_kind="ulysses")
    with pytest.raises(ValueError, match="tp_size"):
        HybridParallelPlugin(tp_size=0)
