"""Booster + HybridParallelPlugin (data x 1D tensor parallel) against plain single-process PyTorch.

Tolerance: fp32, 1e-5 relative per-step loss: tensor parallelism splits matrix products and
sums partial results over ranks (plus the dp gradient average), changing only reduction order.
"""

import pytest
import torch
from colossalai_harness import boosted_losses, boosted_setup, criterion, make_model_and_optim, reference_losses

from colossal.comm.testing import run_distributed
from colossalai import HybridParallelPlugin, TorchDDPPlugin

STEPS = 3


def _hybrid_losses(tp_size):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(tp_size=tp_size))
    return boosted_losses(booster, model, optim, loader, STEPS)


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)], ids=["tp2", "dp2xtp2"])
def test_hybrid_matches_plain_pytorch(world, tp):
    got = run_distributed(_hybrid_losses, world, tp, timeout=180)
    ref = torch.tensor(reference_losses(STEPS))
    for rank_losses in got:
        torch.testing.assert_close(torch.tensor(rank_losses), ref, rtol=1e-5, atol=0)


def _clip_norm():
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(tp_size=2))
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    return booster.clip_grad_norm(optim, 1e-3).item()


def test_hybrid_clips_by_the_dense_gradient_norm():
    torch.manual_seed(0)
    model, _ = make_model_and_optim()
    _, _, _, loader = boosted_setup(TorchDDPPlugin())  # one process: the same first global batch
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    norms = run_distributed(_clip_norm, 2, timeout=120)
    assert norms[0] == pytest.approx(ref, rel=1e-5) and norms[1] == pytest.approx(ref, rel=1e-5)


def test_hybrid_refuses_unsupported_layouts():
    with pytest.raises(NotImplementedError, match="tp_mode"):
        HybridParallelPlugin(tp_mode="2d")
    with pytest.raises(NotImplementedError, match="sp_size"):
        HybridParallelPlugin(sp_size=2)
    with pytest.raises(ValueError, match="tp_size"):
        HybridParallelPlugin(tp_size=0)
