"""Booster + TorchFSDPPlugin (FSDP2) against plain single-process PyTorch (fp32, 1e-5 relative:
only reduction order differs, see test_colossalai_booster_ddp.py)."""

import pytest
import torch
from colossalai_harness import boosted_losses, boosted_setup, reference_losses

from colossal.comm.testing import run_distributed
from colossalai import Booster, TorchFSDPPlugin

STEPS = 4


def _fsdp_losses(lazy: bool):
    booster, model, optim, loader = boosted_setup(TorchFSDPPlugin(), lazy=lazy)
    return boosted_losses(booster, model, optim, loader, STEPS)


def test_fsdp_matches_plain_pytorch_on_two_ranks():
    got = run_distributed(_fsdp_losses, 2, False, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(STEPS)), rtol=1e-5, atol=0)


def test_fsdp_refuses_fp16_and_needs_launch_under_a_multi_rank_launcher(monkeypatch):
    with pytest.raises(NotImplementedError, match="supports mixed_precision"):
        Booster(plugin=TorchFSDPPlugin(), mixed_precision="fp16")
    # a plain process gets a world of one (test_colossalai_single_process.py); a rank started by a
    # launcher for several ranks must call launch() itself
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="rank 0 of 2 .* call colossal.comm.launch"):
        boosted_setup(TorchFSDPPlugin())
