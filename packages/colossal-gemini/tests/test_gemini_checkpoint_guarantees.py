"""Gemini's own save/load entry points keep the Booster's guarantees (2 ranks, gloo):

* a collective called on rank 0 only (``if rank == 0: model.state_dict()``) raises a
  ``CheckpointError`` naming rank 1 after ``checkpoint_timeout`` seconds instead of hanging;
* ``load_sharded`` is strict: one ``CheckpointMismatchError`` (a ``ValueError``) lists every
  missing, unexpected and mis-shaped entry with shapes, on both ranks, before anything changes;
  ``strict=False`` returns the lists;
* a flipped byte or a truncated file raises a ``CheckpointError`` naming the file.
"""

import pytest
import torch
import torch.distributed as dist

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
from colossal.testkit import MISMATCH_LINES, MISSING, call_on_rank0_only, guarantee_case, guarantee_model

TIMEOUT = 2.0


def _build(model):
    ddp = GeminiDDP(model, placement="auto", device_memory_budget=64 << 20, checkpoint_timeout=TIMEOUT)
    optim = GeminiOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-2), ddp)
    torch.manual_seed(dist.get_rank())
    optim.backward(ddp(torch.randn(3, model[0].in_features)).square().mean())
    optim.step()
    optim.zero_grad()
    return ddp, optim


def rank0_only(root: str) -> dict:
    ddp, optim = _build(guarantee_model(0))
    save_sharded(f"{root}/ok", ddp, optim)  # every rank: fine
    cases = {
        "model_state_dict": lambda: ddp.state_dict(),
        "optimizer_state_dict": lambda: optimizer_state_dict(optim),
        "save_sharded": lambda: save_sharded(f"{root}/rank0", ddp, optim),
        "load_sharded": lambda: load_sharded(f"{root}/ok", ddp, optim),
    }
    out = call_on_rank0_only(cases, lambda op: check_arrival(f"colossal.gemini.{op}", timeout=TIMEOUT))
    out["after"] = sorted(model_state_dict(ddp))  # both ranks in step again
    return out


def test_entry_point_on_one_rank_raises_naming_the_other(tmp_path):
    results = run_distributed(rank0_only, 2, str(tmp_path), timeout=240)
    for op in ("model_state_dict", "optimizer_state_dict", "save_sharded", "load_sharded"):
        seconds, error = results[0][op]
        assert isinstance(error, CheckpointError), (op, error)
        assert TIMEOUT <= seconds < TIMEOUT + 10, (op, seconds)
        assert f"colossal.gemini.{op} on rank 0: ranks [1] did not call it within 2 s" in str(error), error
        assert "if rank == 0" in str(error) and "checkpoint_timeout" in str(error)
    assert results[0]["after"] == results[1]["after"]


def _case(root: str, case: str) -> dict:
    return guarantee_case(
        case,
        root,
        build=_build,
        save=lambda engine, path: save_sharded(path, *engine),
        load=lambda engine, path, strict: load_sharded(path, *engine, strict=strict),
        state=lambda engine: engine[0].state_dict(),
    )


def test_load_sharded_is_strict_and_lists_everything_before_changing(tmp_path):
    for r in run_distributed(_case, 2, str(tmp_path), "strict", timeout=240):
        assert isinstance(r["error"], CheckpointMismatchError) and isinstance(r["error"], ValueError), r
        assert all(line in str(r["error"]) for line in MISMATCH_LINES), r["error"]
        assert r["unchanged"], r


def test_non_strict_load_returns_the_lists(tmp_path):
    for r in run_distributed(_case, 2, str(tmp_path), "lenient", timeout=240):
        assert r["error"] is None and r["found"] == (MISSING, [], []), r
        assert r["loaded"] and r["kept"], r


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_names_it(tmp_path, damage):
    for r in run_distributed(_case, 2, str(tmp_path), damage, timeout=240):
        assert isinstance(r["error"], CheckpointError), r
        assert "__1_0.distcp" in str(r["error"]) and r["error"].path.endswith("__1_0.distcp"), r
        assert "truncated or corrupted" in str(r["error"]), r


def test_checkpoint_timeout_must_be_positive():
    with pytest.raises(ValueError, match="checkpoint_timeout must be a positive"):
        GeminiDDP(guarantee_model(0), device_memory_budget=64 << 20, checkpoint_timeout=-1)
