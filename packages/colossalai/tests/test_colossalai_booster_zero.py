"""Booster + ZeroPlugin (colossal.zero, stages 1-3, offload) against plain single-process PyTorch.

Tolerance: fp32, 1e-5 relative per-step loss (ZeRO reduce-scatters gradient sums and steps fp32
shards: only the reduction order differs from the reference).
"""

import pytest
import torch
from colossalai_harness import boosted_losses, boosted_setup, criterion, reference_losses

from colossal.comm.testing import run_distributed
from colossalai import ZeroPlugin

STEPS = 3
CONFIGS = [dict(stage=1), dict(stage=2), dict(stage=3), dict(stage=2, offload=True)]


def _zero_losses(configs):
    out = []
    for cfg in configs:
        booster, model, optim, loader = boosted_setup(ZeroPlugin(**cfg), lazy=cfg["stage"] == 3)
        out.append(boosted_losses(booster, model, optim, loader, STEPS))
    return out


def test_zero_stages_match_plain_pytorch_on_two_ranks():
    ref = torch.tensor(reference_losses(STEPS))
    for cfg, got in zip(CONFIGS, run_distributed(_zero_losses, 2, CONFIGS, timeout=180)[0], strict=True):
        torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=0, msg=lambda m, c=cfg: f"{c}: {m}")


def test_zero_on_one_rank_matches():
    ref = torch.tensor(reference_losses(STEPS))
    got = run_distributed(_zero_losses, 1, [dict(stage=2)], timeout=120)[0][0]
    torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=0)


def _accumulate_and_clip():
    booster, model, optim, loader = boosted_setup(ZeroPlugin(stage=2))
    x, y = next(iter(loader))
    with booster.no_sync(model, optim):
        booster.backward(criterion(model(x[:2]), y[:2]) / 2, optim)
    booster.backward(criterion(model(x[2:]), y[2:]) / 2, optim)
    returned = booster.clip_grad_norm(optim, 0.05).item()  # the norm before clipping, as torch returns it
    optim.step()
    norm = optim.engine.last_grad_norm.item()
    assert returned == pytest.approx(norm, rel=1e-6)
    optim.zero_grad()
    booster.backward(criterion(model(x), y), optim)
    optim.step()  # no clip_grad_norm() this time: the step must not clip
    return norm, optim.engine.config.max_grad_norm, optim.engine.last_grad_norm.item()


def test_zero_no_sync_and_clip_run():
    out = run_distributed(_accumulate_and_clip, 2, timeout=120)
    (norm0, after0, last0), (norm1, _, _) = out
    assert norm0 == pytest.approx(norm1) and norm0 > 0.05
    assert after0 is None and last0 == norm0  # the clip applied to one step only


def test_zero_refuses_bad_config():
    with pytest.raises(ValueError, match="stage"):
        ZeroPlugin(stage=4)
