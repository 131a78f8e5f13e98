"""The fault matrix of colossal.comm: a rank that dies in the middle of a collective, a rank that
stops joining collectives, and ranks that issue different collectives (debug mode).

None of these may hang: each test bounds its wall time well below the harness deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from colossal.comm import (
    CollectiveMismatchError,
    all_gather,
    all_gather_list,
    all_reduce,
    all_to_all,
    all_to_all_dims,
    broadcast,
    debug_enabled,
    reduce,
    reduce_scatter,
    ring_exchange,
    set_debug,
)
from colossal.comm.launch import DEFAULT_TIMEOUT_S, resolve_timeout
from colossal.comm.testing import RankFailure, run_distributed

BOUND_S = 45.0  # a failure must surface this fast (generous: 2 shared cores); the deadline is 120 s


def _die_in_all_reduce_loop(victim: int, at_step: int, exitcode: int) -> None:
    t = torch.ones(4096)
    for step in range(10_000):
        if dist.get_rank() == victim and step == at_step:
            os._exit(exitcode)  # no exception, no goodbye: as if the process were killed
        all_reduce(t)
        t.fill_(1.0)


def test_a_rank_dying_mid_collective_fails_the_run_in_seconds_naming_it():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 died with exit code 13") as info:
        run_distributed(_die_in_all_reduce_loop, 3, 1, 5, 13, timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    # The survivors were blocked in all_reduce with rank 1: each raised by itself (gloo sees the
    # closed connection) instead of waiting out the process-group timeout.
    message = str(info.value)
    assert "rank 0 then failed" in message and "rank 2 then failed" in message, message


def _stop_joining(stall_s: float) -> float:
    t = torch.ones(16)
    all_reduce(t)  # everyone meets once
    if dist.get_rank() == 1:
        time.sleep(stall_s)  # alive, but never issues the next collective
        return 0.0
    start = time.monotonic()
    all_reduce(t)
    return time.monotonic() - start


def test_a_rank_that_stops_joining_times_out_at_the_process_group_timeout():
    start = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timed? ?out") as info:
        run_distributed(_stop_joining, 2, 60.0, timeout=120, pg_timeout=3.0)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 3.0 + BOUND_S, f"took {elapsed:.1f} s"
    assert "rank 0" in str(info.value.__cause__)


# -- debug mode: ranks issuing different collectives --------------------------------------------


def _diverge(matching: int) -> str:
    """``matching`` identical collectives, then rank 0 all-reduces while rank 1 broadcasts."""
    set_debug(True, timeout=30)
    t = torch.arange(6.0)
    for _ in range(matching):
        all_reduce(t)
        all_gather(t)
    try:
        if dist.get_rank() == 0:
            all_reduce(t)  # DIVERGE-RANK0
        else:
            broadcast(t, src=0)  # DIVERGE-RANK1
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def _line_of(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def test_debug_mode_names_the_first_divergent_collective_on_every_rank():
    messages = run_distributed(_diverge, 2, 2, timeout=120)
    for message in messages:
        assert "collective #5 " in message, message  # 2 x (all_reduce, all_gather), then the fifth
        assert "rank 0: all_reduce(sum) float32[6]" in message, message
        assert "rank 1: broadcast(src=0) float32[6]" in message, message
        assert f"test_comm_faults.py:{_line_of('DIVERGE-RANK0')} in _diverge" in message, message
        assert f"test_comm_faults.py:{_line_of('DIVERGE-RANK1')} in _diverge" in message, message


def _mismatch(kind: str) -> str:
    set_debug(True, timeout=30)
    rank = dist.get_rank()
    try:
        if kind == "shape":
            all_reduce(torch.zeros(4 + rank))
        elif kind == "dtype":
            all_reduce(torch.zeros(4, dtype=torch.float32 if rank == 0 else torch.float64))
        elif kind == "op":
            all_reduce(torch.zeros(4), op="sum" if rank == 0 else "max")
        elif kind == "root":
            broadcast(torch.zeros(4), src=rank)
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("shape", ["float32[4]", "float32[5]"]),
        ("dtype", ["float32[4]", "float64[4]"]),
        ("op", ["all_reduce(sum)", "all_reduce(max)"]),
        ("root", ["broadcast(src=0)", "broadcast(src=1)"]),
    ],
)
def test_debug_mode_catches_a_different_shape_dtype_reduction_or_root(kind, expected):
    for message in run_distributed(_mismatch, 2, kind, timeout=120):
        assert "collective #1 " in message and all(e in message for e in expected), message


def _one_rank_skips() -> str:
    set_debug(True, timeout=3)
    if dist.get_rank() == 1:
        return "skipped"  # rank 1 never issues the collective
    try:
        all_reduce(torch.ones(3))
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_debug_mode_names_a_rank_that_never_reaches_the_collective():
    message = run_distributed(_one_rank_skips, 2, timeout=120)[0]
    assert "rank 1 did not reach collective #1 within 3 s" in message, message
    assert "it issued none" in message and "all_reduce(sum)" in message, message


def _agree() -> list:
    set_debug(True, timeout=30)
    rank = dist.get_rank()
    t = torch.arange(4.0) + rank
    all_reduce(t)
    gathered = all_gather(t.clone())
    broadcast(t, src=1)
    # Every other collective, issued the same way on both ranks, passes the check; uneven
    # all_to_all splits legitimately differ in rows per rank.
    reduce_scatter(torch.ones(4, 3), op="max", dim=0)
    all_to_all(torch.ones(1 + rank, 2), output_split_sizes=[[1, 1], [0, 1]][rank], input_split_sizes=[1, rank])
    all_to_all_dims(torch.ones(2, 4), scatter_dim=1, gather_dim=0)
    reduce(torch.ones(3), dst=0, op=torch.distributed.ReduceOp.MIN)
    all_gather_list(torch.ones(2))
    ring_exchange(torch.ones(2))
    return [t, gathered]


def test_debug_mode_passes_agreeing_collectives_and_keeps_results():
    t0, g0 = run_distributed(_agree, 2, timeout=120)[0]
    summed = torch.arange(4.0) * 2 + 1
    torch.testing.assert_close(t0, summed, rtol=0, atol=0)
    torch.testing.assert_close(g0, torch.cat([summed, summed]), rtol=0, atol=0)


def test_debug_mode_is_off_by_default_and_set_by_environment():
    assert not debug_enabled()
    with pytest.raises(ValueError, match="timeout must be positive"):
        set_debug(True, timeout=0)
    assert not debug_enabled()
    code = "from colossal.comm import debug_enabled; print(debug_enabled())"
    for value, expected in (("1", "True"), ("0", "False")):
        env = {**os.environ, "COLOSSAL_COMM_DEBUG": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expected, out.stderr


def test_process_group_timeout_default_and_environment_override():
    assert resolve_timeout(env={}) == DEFAULT_TIMEOUT_S == 1800.0
    assert resolve_timeout(env={"COLOSSAL_COMM_TIMEOUT": "90"}) == 90.0
    assert resolve_timeout(12.5, env={"COLOSSAL_COMM_TIMEOUT": "90"}) == 12.5
    with pytest.raises(ValueError, match="COLOSSAL_COMM_TIMEOUT must be a number of seconds, got 'soon'"):
        resolve_timeout(env={"COLOSSAL_COMM_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="COLOSSAL_COMM_TIMEOUT must be positive seconds, got -1.0"):
        resolve_timeout(env={"COLOSSAL_COMM_TIMEOUT": "-1"})


# -- the same under torchrun: the agent notices the dead worker, stops the others, names it ------

_TORCHRUN_SCRIPT = """
import os
import torch
import torch.distributed as dist
from colossal.comm import all_reduce, launch

launch(backend="gloo")
t = torch.ones(4096)
for step in range(1_000_000):
    if dist.get_rank() == 1 and step == 5:
        os._exit(13)
    all_reduce(t)
    t.fill_(1.0)
"""


def test_torchrun_reports_a_rank_dying_mid_collective_in_seconds(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(_TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    report = out.stdout + out.stderr
    assert "exitcode  : 13" in report and "rank      : 1 " in report, report  # torchrun's failure table
    assert elapsed < 20 + BOUND_S, f"took {elapsed:.1f} s"  # ~10 s of it is starting Python + torch twice


_RESTART_SCRIPT = """
import os, time
import torch
import torch.distributed as dist
from colossal.comm import all_reduce, launch

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(3)  # rank 0 of the new attempt reaches the store first
launch(backend="gloo")
t = torch.ones(4)
all_reduce(t)
if attempt == 0 and rank == 1:
    os._exit(13)
all_reduce(t)
print(f"attempt {attempt} rank {rank} sum {t.tolist()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_restart_rendezvous_ignores_the_previous_attempt(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(_RESTART_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--monitor-interval", "0.5", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLOSSAL_COMM_TIMEOUT": "30"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    for rank in (0, 1):
        assert f"attempt 1 rank {rank} sum [4.0, 4.0, 4.0, 4.0]" in report, report
