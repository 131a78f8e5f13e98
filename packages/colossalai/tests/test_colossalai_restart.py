"""``torchrun --max-restarts 1`` after a crash resumes from the latest run checkpoint and ends
bitwise equal to an uninterrupted run: model, optimizer, LR scheduler, loss scaler, every rank's
torch and Python RNG, data position and the loss of every step (``restartable_train.py``).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).with_name("restartable_train.py")
WORLD = 2
TIMEOUT_S = 420  # two torchrun attempts, each starting Python + torch on 2 ranks, on 2 shared cores


def _torchrun(tmp: pathlib.Path, name: str, *args: str, restarts: int = 0) -> tuple[pathlib.Path, str]:
    root, out = tmp / name / "ckpt", tmp / name / "out"
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += [f"--max-restarts={restarts}", "--monitor-interval=0.5", str(SCRIPT), str(root), str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A session of its own, so that a timeout kills torchrun's workers too, not only torchrun.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s:\n{log}")
    assert proc.returncode == 0, log
    return out, log


def _assert_bitwise(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())), where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), f"{where} differs bitwise"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_torchrun_restart_after_a_crash_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    reference, _ = _torchrun(tmp_path, "uninterrupted")
    resumed, log = _torchrun(tmp_path, "crashed", "--crash-at", "11", restarts=1)
    # Attempt 0 started from scratch; rank 1 died before step 11; attempt 1 resumed at step 9 (the
    # latest save: every 3 steps) and redid steps 9 and 10.
    for rank in range(WORLD):
        assert (resumed / f"attempt0-rank{rank}.txt").read_text() == "0"
        assert (resumed / f"attempt1-rank{rank}.txt").read_text() == "9", log
    assert not (reference / "attempt1-rank0.txt").exists()
    for rank in range(WORLD):
        want = torch.load(reference / f"rank{rank}.pt", weights_only=False)
        got = torch.load(resumed / f"rank{rank}.pt", weights_only=False)
        assert sorted(want["losses"]) == list(range(16))
        assert want["scaler"] != {} and not torch.isfinite(want["losses"][4])  # the overflow happened
        _assert_bitwise(got, want, f"rank{rank}")
