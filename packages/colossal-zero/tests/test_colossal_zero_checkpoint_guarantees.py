"""ZeRO's own save/load entry points keep the Booster's guarantees (2 ranks, gloo):

* a collective called on rank 0 only (``if rank == 0: zero.state_dict()``) raises a
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
from colossal.testkit import MISMATCH_LINES, MISSING, damage_file, guarantee_model
from colossal.zero import ZeroOptimizer

TIMEOUT = 2.0


def _zero(model: nn.Module, stage: int = 2) -> ZeroOptimizer:
    return ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=stage, checkpoint_timeout=TIMEOUT)


_model = guarantee_model


def _step(zero: ZeroOptimizer) -> None:
    torch.manual_seed(dist.get_rank())
    zero.backward(zero.module(torch.randn(3, 4)).square().mean())
    zero.step()
    zero.zero_grad()


def rank0_only(root: str, stage: int) -> dict:
    """Each entry point called on rank 0 alone: rank 0 must raise in about TIMEOUT seconds; rank 1
    then calls the same check (as if it caught up) so the next case starts in step."""
    zero = _zero(_model(0), stage)
    _step(zero)
    zero.save_sharded(f"{root}/ok")  # every rank: fine
    cases = {
        "full_optimizer_state_dict": lambda: zero.state_dict(),
        "full_model_state_dict": lambda: zero.full_model_state_dict(),
        "load_full_model_state_dict": lambda: zero.load_full_model_state_dict(_model(0).state_dict()),
        "save_sharded": lambda: zero.save_sharded(f"{root}/rank0"),
        "load_sharded": lambda: zero.load_sharded(f"{root}/ok"),
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
            check_arrival(f"colossal.zero.{op}", timeout=TIMEOUT)  # catch up: rank 0's key is there
    out["after"] = sorted(zero.full_model_state_dict())  # both ranks in step again
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_entry_point_on_one_rank_raises_naming_the_other(tmp_path, stage):
    results = run_distributed(rank0_only, 2, str(tmp_path), stage, timeout=240)
    for op in ("full_optimizer_state_dict", "full_model_state_dict", "load_full_model_state_dict"):
        seconds, message = results[0][op]
        assert TIMEOUT <= seconds < TIMEOUT + 10, (op, seconds)
        assert f"colossal.zero.{op} on rank 0: ranks [1] did not call it within 2 s" in message, message
        assert "if rank == 0" in message and "checkpoint_timeout" in message
    for op in ("save_sharded", "load_sharded"):
        assert "ranks [1] did not call it" in results[0][op][1], results[0][op]
    assert "save_sharded" not in results[1] and results[0]["after"] == results[1]["after"]


def save_then_load(root: str, case: str) -> dict:
    zero = _zero(_model(0))
    _step(zero)
    zero.save_sharded(root)
    saved = zero.full_model_state_dict()
    if case == "strict":
        other = _zero(_model(1, extra=True, transposed=True))
        before = other.full_model_state_dict()
        with pytest.raises(CheckpointMismatchError) as err:
            other.load_sharded(root)
        unchanged = all(torch.equal(before[k], v) for k, v in other.full_model_state_dict().items())
        return {"message": str(err.value), "value_error": isinstance(err.value, ValueError), "unchanged": unchanged}
    if case == "lenient":
        other = _zero(_model(1, extra=True))
        fresh = other.full_model_state_dict()
        found = other.load_sharded(root, strict=False)
        after = other.full_model_state_dict()
        loaded = all(torch.equal(after[k], saved[k]) for k in saved)
        kept = torch.equal(after["3.weight"], fresh["3.weight"])
        return {"found": tuple(found), "loaded": loaded, "kept": kept}
    dist.barrier()
    if dist.get_rank() == 0:  # damage one file after every rank saved
        damage_file(sorted(pathlib.Path(root).glob("__1_*.distcp"))[0], case)
    dist.barrier()
    other = _zero(_model(1))
    with pytest.raises(CheckpointError) as err:
        other.load_sharded(root)
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
        ZeroOptimizer(torch.optim.SGD(_model(0).parameters(), lr=0.1), _model(0), checkpoint_timeout=0)
