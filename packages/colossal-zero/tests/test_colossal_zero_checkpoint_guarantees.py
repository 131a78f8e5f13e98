"""ZeRO's own save/load entry points keep the Booster's guarantees (2 ranks, gloo):

* a collective called on rank 0 only (``if rank == 0: zero.state_dict()``) raises a
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
from colossal.testkit import MISMATCH_LINES, MISSING, call_on_rank0_only, guarantee_case, guarantee_model
from colossal.zero import ZeroOptimizer

TIMEOUT = 2.0


def _build(model, stage: int = 2) -> ZeroOptimizer:
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=stage, checkpoint_timeout=TIMEOUT)
    torch.manual_seed(dist.get_rank())
    zero.backward(model(torch.randn(3, model[0].in_features)).square().mean())
    zero.step()
    zero.zero_grad()
    return zero


def rank0_only(root: str, stage: int) -> dict:
    zero = _build(guarantee_model(0), stage)
    zero.save_sharded(f"{root}/ok")  # every rank: fine
    cases = {
        "full_optimizer_state_dict": lambda: zero.state_dict(),
        "full_model_state_dict": lambda: zero.full_model_state_dict(),
        "load_full_model_state_dict": lambda: zero.load_full_model_state_dict(guarantee_model(0).state_dict()),
        "save_sharded": lambda: zero.save_sharded(f"{root}/rank0"),
        "load_sharded": lambda: zero.load_sharded(f"{root}/ok"),
    }
    out = call_on_rank0_only(cases, lambda op: check_arrival(f"colossal.zero.{op}", timeout=TIMEOUT))
    out["after"] = sorted(zero.full_model_state_dict())  # both ranks in step again
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_entry_point_on_one_rank_raises_naming_the_other(tmp_path, stage):
    results = run_distributed(rank0_only, 2, str(tmp_path), stage, timeout=240)
    for op in ("full_optimizer_state_dict", "full_model_state_dict", "load_full_model_state_dict", "save_sharded",
               "load_sharded"):  # fmt: skip
        seconds, error = results[0][op]
        assert isinstance(error, CheckpointError), (op, error)
        assert TIMEOUT <= seconds < TIMEOUT + 10, (op, seconds)
        assert f"colossal.zero.{op} on rank 0: ranks [1] did not call it within 2 s" in str(error), error
        assert "if rank == 0" in str(error) and "checkpoint_timeout" in str(error)
    assert results[0]["after"] == results[1]["after"]


def _case(root: str, case: str) -> dict:
    return guarantee_case(
        case,
        root,
        build=_build,
        save=lambda zero, path: zero.save_sharded(path),
        load=lambda zero, path, strict: zero.load_sharded(path, strict=strict),
        state=lambda zero: zero.full_model_state_dict(),
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
    model = guarantee_model(0)
    with pytest.raises(ValueError, match="checkpoint_timeout must be a positive"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, checkpoint_timeout=0)
