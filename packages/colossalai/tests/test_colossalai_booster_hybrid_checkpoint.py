"""HybridParallelPlugin checkpoints are portable: saved by a 2D / 2.5D / 3D / sequence-parallel /
tensor x sequence parallel / pipeline x tensor parallel layout (dense names, full logical tensors),
resumed by another plugin or layout (a pipeline with ZeRO among them) with the losses of an
uninterrupted run; the exported safetensors load into a plain PyTorch GPT.

Tolerance: 1e-5 relative on the per-step mean loss (fp32; see test_colossalai_booster_hybrid.py).
"""

import pytest
import torch
from colossalai_harness import TOTAL, boosted_losses, boosted_setup, reference_losses, resume_and_train, train_and_save

from colossal.comm.testing import run_distributed
from colossalai import HybridParallelPlugin
from colossalai.checkpoint import load_safetensors_folder
from colossalai.models import build_gpt

MATRIX = [  # ((world, plugin kwargs; {} = ddp) saving, (world, kwargs) resuming)
    ((4, dict(tp_size=4, tp_mode="2d")), (1, {})),
    ((2, {}), (8, dict(tp_size=8, tp_mode="2.5d", tp_depth=2))),
    ((4, dict(tp_size=1, sp_size=2)), (8, dict(tp_size=8, tp_mode="3d"))),
    ((4, dict(tp_size=2, sp_size=2)), (2, dict(tp_size=2))),
    ((4, dict(tp_size=2, pp_size=2)), (2, {})),
    ((1, {}), (4, dict(tp_size=1, pp_size=2, zero_stage=1, pp_schedule="zero_bubble"))),
]
IDS = ["hybrid2d4-to-ddp1", "ddp2-to-hybrid2.5d8", "hybrid-dp2xsp2-to-hybrid3d8", "hybrid-sp2xtp2-to-hybrid-tp2"]
IDS += ["hybrid-pp2xtp2-to-ddp2", "ddp1-to-hybrid-pp2xdp2-zero1-zero_bubble"]


@pytest.mark.parametrize("save,load", MATRIX, ids=IDS)
def test_hybrid_resume_across_plugins_and_layouts(tmp_path, save, load):
    before = run_distributed(train_and_save, save[0], save[1], str(tmp_path), timeout=120)[0]
    after = run_distributed(resume_and_train, load[0], load[1], str(tmp_path), timeout=120)[0]
    torch.testing.assert_close(torch.tensor(before + after), torch.tensor(reference_losses(TOTAL)), rtol=1e-5, atol=0)


def _export(folder):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(tp_size=4, tp_mode="2d"))
    boosted_losses(booster, model, optim, loader, 1)
    booster.export_safetensors(model, folder, max_shard_bytes=40_000)
    return model(torch.arange(64).view(2, 32)).detach()  # 2D needs a batch divisible by q = 2


def test_hybrid_2d_safetensors_export_loads_in_plain_torch(tmp_path):
    logits = run_distributed(_export, 4, str(tmp_path), timeout=120)[0]
    model = build_gpt("tiny", block_size=32, seed=1)
    model.load_state_dict(load_safetensors_folder(tmp_path), strict=True)
    torch.testing.assert_close(model(torch.arange(64).view(2, 32)), logits, rtol=1e-5, atol=1e-6)
