"""Checkpoints: save with one plugin and world size, resume with another, same losses as an
uninterrupted run; a save that dies midway leaves the previous checkpoint loadable; safetensors
export loads into a plain PyTorch model.

Tolerance: 1e-5 relative on the per-step mean loss (fp32; see test_colossalai_booster_ddp.py).
"""

import json

import pytest
import torch
from colossalai_harness import GLOBAL_BATCH, boosted_losses, boosted_setup, reference_losses
from safetensors.torch import load_file

from colossal.comm.testing import run_distributed
from colossalai import RunState
from colossalai.booster.registry import make_plugin
from colossalai.checkpoint import INDEX_NAME, load_safetensors_folder, read_latest
from colossalai.models import build_gpt

SAVE_AT, TOTAL = 2, 4


def _plugin(spec: str):
    """'zero3' -> ZeroPlugin(stage=3); other names as registered."""
    return make_plugin("zero", stage=int(spec[4:])) if spec.startswith("zero") else make_plugin(spec)


def _train_and_save(plugin: str, root: str):
    booster, model, optim, loader = boosted_setup(_plugin(plugin))
    losses = boosted_losses(booster, model, optim, loader, SAVE_AT)
    state = RunState(step=SAVE_AT, consumed_samples=SAVE_AT * GLOBAL_BATCH, extra={"plugin": plugin})
    booster.save_run(root, model, optim, state=state)
    return losses


def _resume(plugin: str, root: str):
    booster, model, optim, loader = boosted_setup(_plugin(plugin))
    state = booster.load_run(root, model, optim, dataloader=loader)
    return boosted_losses(booster, model, optim, loader, TOTAL, start=state.step)


def _run(fn, world, *args):
    return run_distributed(fn, world, *args, timeout=120)[0]


MATRIX = [
    (("ddp", 2), ("hybrid", 2)),
    (("hybrid", 2), ("zero2", 1)),
    (("zero3", 2), ("fsdp", 1)),
    (("fsdp", 2), ("gemini", 2)),
    (("gemini", 2), ("zero1", 1)),
]


@pytest.mark.parametrize("save,load", MATRIX, ids=[f"{a[0]}{a[1]}-to-{b[0]}{b[1]}" for a, b in MATRIX])
def test_resume_across_plugins_and_world_sizes(tmp_path, save, load):
    ref = reference_losses(TOTAL)
    before = _run(_train_and_save, save[1], save[0], str(tmp_path))
    after = _run(_resume, load[1], load[0], str(tmp_path))
    torch.testing.assert_close(torch.tensor(before + after), torch.tensor(ref), rtol=1e-5, atol=0)
    assert read_latest(tmp_path).name == f"step-{SAVE_AT:08d}"


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import colossalai.booster.booster as booster_module

    booster, model, optim, loader = boosted_setup(make_plugin("ddp"))
    boosted_losses(booster, model, optim, loader, 1)
    booster.save_run(tmp_path, model, optim, state=RunState(step=1, consumed_samples=GLOBAL_BATCH))
    boosted_losses(booster, model, optim, loader, 2, start=1)

    def crash(folder, payload):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(booster_module, "save_run_files", crash)
    with pytest.raises(KeyboardInterrupt):
        booster.save_run(tmp_path, model, optim, state=RunState(step=2, consumed_samples=2 * GLOBAL_BATCH))
    monkeypatch.undo()
    assert (tmp_path / ".step-00000002.partial").is_dir() and not (tmp_path / "step-00000002").exists()
    assert read_latest(tmp_path).name == "step-00000001"
    booster2, model2, optim2, loader2 = boosted_setup(make_plugin("ddp"))
    state = booster2.load_run(tmp_path, model2, optim2, dataloader=loader2)
    assert state.step == 1
    got = boosted_losses(booster2, model2, optim2, loader2, 3, start=1)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(3, start=1)), rtol=1e-5, atol=0)
    booster2.save_run(tmp_path, model2, optim2, state=RunState(step=3, consumed_samples=3 * GLOBAL_BATCH))
    assert not (tmp_path / ".step-00000002.partial").exists()
    assert read_latest(tmp_path).name == "step-00000003"


def _export(folder: str):
    booster, model, optim, loader = boosted_setup(make_plugin("fsdp"))
    boosted_losses(booster, model, optim, loader, 2)
    booster.export_safetensors(model, folder, max_shard_bytes=40_000)
    x = torch.arange(32).view(1, 32)
    return model(x).full_tensor() if hasattr(model(x), "full_tensor") else model(x).detach()


def test_safetensors_export_from_sharded_plugin_loads_in_plain_torch(tmp_path):
    logits = run_distributed(_export, 2, str(tmp_path), timeout=120)[0]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and index["metadata"]["total_size"] > 0
    state = {}
    for shard in shards:  # what any Hugging Face style loader does
        state.update(load_file(str(tmp_path / shard)))
    model = build_gpt("tiny", block_size=32, seed=1)
    model.load_state_dict(state, strict=True)
    torch.testing.assert_close(model(torch.arange(32).view(1, 32)), logits.detach(), rtol=1e-5, atol=1e-6)
    assert set(load_safetensors_folder(tmp_path)) == set(state)
