"""Booster + GeminiPlugin (colossal.gemini) against plain single-process PyTorch.

Tolerance: fp32, 1e-5 relative per-step loss (chunked fp32 masters and reduce-scattered gradients:
only the reduction order differs from the reference).
"""

import pytest
import torch
from colossalai_harness import boosted_losses, boosted_setup, reference_losses

from colossal.comm.testing import run_distributed
from colossalai import GeminiPlugin

STEPS = 3
CONFIGS = [dict(placement="auto", device_memory_budget=4 << 20), dict(placement="static", device_memory_budget="1GiB")]


def _gemini_losses(configs):
    out = []
    for cfg in configs:
        booster, model, optim, loader = boosted_setup(GeminiPlugin(**cfg))
        out.append(boosted_losses(booster, model, optim, loader, STEPS))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_gemini_matches_plain_pytorch(world):
    ref = torch.tensor(reference_losses(STEPS))
    configs = CONFIGS if world == 2 else CONFIGS[:1]
    for cfg, got in zip(configs, run_distributed(_gemini_losses, world, configs, timeout=180)[0], strict=True):
        torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=0, msg=lambda m, c=cfg: f"{c}: {m}")


def test_gemini_refuses_bad_config():
    with pytest.raises(ValueError, match="placement"):
        GeminiPlugin(placement="belady")
    with pytest.raises(ValueError, match="device_memory_budget"):
        GeminiPlugin(device_memory_budget=0)


def _clip_once():
    from colossalai_harness import criterion

    booster, model, optim, loader = boosted_setup(GeminiPlugin(placement="auto", device_memory_budget=4 << 20))
    x, y = next(iter(loader))
    booster.backward(criterion(model(x), y), optim)
    booster.clip_grad_norm(optim, 0.05, norm_type=1.0)
    during = (optim.engine.max_grad_norm, optim.engine.norm_type)
    optim.step()
    return during, (optim.engine.max_grad_norm, optim.engine.norm_type)


def test_gemini_clip_applies_to_the_next_step_only():
    during, after = run_distributed(_clip_once, 1, timeout=120)[0]
    assert during == (0.05, 1.0) and after == (None, 2.0)
