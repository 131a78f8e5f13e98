"""Gemini's own save/load entry points keep the Booster's guarantees (2 ranks, gloo):

* a collective called on rank 0 only (``if rank == 0: model.state_dict()``) raises a
  ``CheckpointError`` naming rank 1 after ``checkpoint_timeout`` seconds instead of hanging;
* ``load_sharded`` is strict: one ``CheckpointMismatchError`` (a ``ValueError``) lists every
  missing, unexpected and mis-shaped entry with shapes, on both ranks, before anything changes;
  ``strict=False`` returns the lists;
* a flipped byte or a truncated file raises a ``CheckpointError`` naming the file.
"""

import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.comm import check_arrival
from colossal.comm.checkpoint import CheckpointError, CheckpointMismatchError
from colossal.comm.testing import run_distributed
from colossal.gemini import (
    GeminiDDP,
    GeminiOptimizer,
    load_sharded,
    model_state_dict,
    optimizer_state_dict,
    save_sharded,
)
from colossal.testkit import MISMATCH_LINES, MISSING, damage_file, guarantee_model

TIMEOUT = 2.0


_model = guarantee_model


def _gemini(model: nn.Module):
    ddp = GeminiDDP(model, placement="auto", device_memory_budget=64 << 20, checkpoint_timeout=TIMEOUT)
    return ddp, GeminiOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-2), ddp)


def _step(ddp, optim) -> None:
    torch.manual_seed(dist.get_rank())
    optim.backward(ddp(torch.randn(3, 4)).square().mean())
    optim.step()
    optim.zero_grad()


def rank0_only(root: str) -> dict:
    """Each entry point called on rank 0 alone: rank 0 must raise in about TIMEOUT seconds; rank 1
    then calls the same check (as if it caught up) so the next case starts in step."""
    ddp, optim = _gemini(_model(0))
    _step(ddp, optim)
    save_sharded(f"{root}/ok", ddp, optim)  # every rank: fine
    cases = {
        "model_state_dict": lambda: ddp.state_dict(),
        "optimizer_state_dict": lambda: optimizer_state_dict(optim),
        "save_sharded": lambda: save_sharded(f"{root}/rank0", ddp, optim),
        "load_sharded": lambda: load_sharded(f"{root}/ok", ddp, optim),
    }
    out = {}
    for op, call in cases.items():
        if dist.get_rank() == 0:
            start = time.perf_counter()
            with pytest.raises(CheckpointError) as err:
                call()
            out[op] = (time.perf_counter() - start, str(err.value))
        dist.barrier()
        if dist.get_rank() == 1:
            check_arrival(f"colossal.gemini.{op}", timeout=TIMEOUT)  # catch up: rank 0's key is there
    out["after"] = sorted(model_state_dict(ddp))  # both ranks in step again
    return out


def test_entry_point_on_one_rank_raises_naming_the_other(tmp_path):
    results = run_distributed(rank0_only, 2, str(tmp_path), timeout=240)
    for op in ("model_state_dict", "optimizer_state_dict", "save_sharded", "load_sharded"):
        seconds, message = results[0][op]
        assert TIMEOUT <= seconds < TIMEOUT + 10, (op, seconds)
        assert f"colossal.gemini.{op} on rank 0: ranks [1] did not call it within 2 s" in message, message
        assert "if rank == 0" in message and "checkpoint_timeout" in message
    assert results[0]["after"] == results[1]["after"]


def save_then_load(root: str, case: str) -> dict:
    ddp, optim = _gemini(_model(0))
    _step(ddp, optim)
    save_sharded(root, ddp, optim)
    saved = ddp.state_dict()
    if case == "strict":
        other, other_optim = _gemini(_model(1, extra=True, transposed=True))
        before = other.state_dict()
        with pytest.raises(CheckpointMismatchError) as err:
            load_sharded(root, other, other_optim)
        unchanged = all(torch.equal(before[k], v) for k, v in other.state_dict().items())
        return {"message": str(err.value), "value_error": isinstance(err.value, ValueError), "unchanged": unchanged}
    if case == "lenient":
        other, other_optim = _gemini(_model(1, extra=True))
        fresh = other.state_dict()
        found = load_sharded(root, other, other_optim, strict=False)
        after = other.state_dict()
        loaded = all(torch.equal(after[k], saved[k]) for k in saved)
        kept = torch.equal(after["3.weight"], fresh["3.weight"])
        return {"found": tuple(found), "loaded": loaded, "kept": kept}
    dist.barrier()
    if dist.get_rank() == 0:  # damage one file after every rank saved
        damage_file(sorted(pathlib.Path(root).glob("__1_*.distcp"))[0], case)
    dist.barrier()
    other, other_optim = _gemini(_model(1))
    with pytest.raises(CheckpointError) as err:
        load_sharded(root, other, other_optim)
    return {"message": str(err.value), "path": err.value.path}


def test_load_sharded_is_strict_and_lists_everything_before_changing(tmp_path):
    for r in run_distributed(save_then_load, 2, str(tmp_path), "strict", timeout=240):
        assert r["value_error"] and r["unchanged"], r
        assert all(line in r["message"] for line in MISMATCH_LINES), r["message"]


def test_non_strict_load_returns_the_lists(tmp_path):
    for r in run_distributed(save_then_load, 2, str(tmp_path), "lenient", timeout=240):
        assert r["found"] == (MISSING, [], []), r
        assert r["loaded"] and r["kept"], r


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_names_it(tmp_path, damage):
    for r in run_distributed(save_then_load, 2, str(tmp_path), damage, timeout=240):
        assert "__1_0.distcp" in r["message"] and r["path"].endswith("__1_0.distcp"), r
        assert "truncated or corrupted" in r["message"], r


def test_checkpoint_timeout_must_be_positive():
    with pytest.raises(ValueError, match="checkpoint_timeout must be a positive"):
        GeminiDDP(_model(0), device_memory_budget=64 << 20, checkpoint_timeout=-1)
