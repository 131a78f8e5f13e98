"""The arrival check: a collective called on some ranks only raises, naming the missing ranks,
within the timeout (instead of hanging); different operations at the same point raise on every
rank; sub-groups are checked over their own members; nested checks are skipped; the store keeps
at most two keys per rank and group."""

import time

import pytest
import torch.distributed as dist

from colossal.comm import ArrivalError, check_arrival, monitored, monitored_call, resolve_arrival_timeout
from colossal.comm.testing import run_distributed

TIMEOUT = 1.5


def _timed(fn) -> tuple[float, ArrivalError]:
    start = time.perf_counter()
    with pytest.raises(ArrivalError) as err:
        fn()
    return time.perf_counter() - start, err.value


def arrival_cases() -> dict:
    rank, out = dist.get_rank(), {}
    for _ in range(6):  # every rank: fine, and old keys are deleted
        check_arrival("ok", timeout=TIMEOUT)
    store = dist.distributed_c10d._get_default_store()
    gname = dist.group.WORLD.group_name
    out["old_key_kept"] = store.check([f"colossal.comm.arrival/{gname}/1/{rank}"])
    out["recent_key_kept"] = store.check([f"colossal.comm.arrival/{gname}/5/{rank}"])

    if rank == 0:  # the mistake: only rank 0 calls it
        seconds, err = _timed(lambda: check_arrival("save", timeout=TIMEOUT, hint="call it on every rank"))
        out["missing"] = (seconds, str(err), err.missing)
    dist.barrier()
    if rank != 0:
        check_arrival("save", timeout=TIMEOUT)  # catch up

    _, err = _timed(lambda: check_arrival("save" if rank == 0 else "load", timeout=TIMEOUT))
    out["different"] = str(err)

    sub = dist.new_group([1, 2])
    if rank == 1:  # rank 2 of the sub-group does not come; rank 0 is not a member
        seconds, err = _timed(lambda: check_arrival("gather", sub, TIMEOUT))
        out["sub"] = (seconds, err.missing)
    if rank == 0:
        check_arrival("gather", sub, TIMEOUT)  # not a member: returns at once
    dist.barrier()

    @monitored("inner", lambda: (None, TIMEOUT))
    def inner() -> str:
        return "ran"

    with monitored_call("outer", None, TIMEOUT):  # every rank
        out["nested"] = inner() if rank == 0 else None  # only rank 0: skipped inside a monitored call
    return out


def test_arrival_check_names_missing_ranks_and_different_operations():
    results = run_distributed(arrival_cases, 3, timeout=180)
    seconds, message, missing = results[0]["missing"]
    assert TIMEOUT <= seconds < TIMEOUT + 5, seconds
    assert missing == [1, 2] and "save on rank 0: ranks [1, 2] did not call it within 1.5 s" in message, message
    assert message.endswith("call it on every rank"), message
    for r in results:
        assert "called different operations" in r["different"] and "'load'" in r["different"], r["different"]
        assert not r["old_key_kept"] and r["recent_key_kept"]
    assert TIMEOUT <= results[1]["sub"][0] < TIMEOUT + 5 and results[1]["sub"][1] == [2]
    assert results[0]["nested"] == "ran"


def test_timeout_resolution(monkeypatch):
    monkeypatch.delenv("COLOSSAL_COMM_TIMEOUT", raising=False)
    assert resolve_arrival_timeout() == 300.0 and resolve_arrival_timeout(2) == 2.0
    monkeypatch.setenv("COLOSSAL_COMM_TIMEOUT", "7.5")
    assert resolve_arrival_timeout() == 7.5 and resolve_arrival_timeout(3.0) == 3.0
    monkeypatch.setenv("COLOSSAL_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="COLOSSAL_COMM_TIMEOUT must be a number of seconds, got 'soon'"):
        resolve_arrival_timeout()
    with pytest.raises(ValueError, match="timeout must be positive seconds, got 0"):
        resolve_arrival_timeout(0)


def test_no_op_without_torch_distributed():
    assert not dist.is_initialized()
    check_arrival("save", timeout=0.1)  # returns at once
