"""A failure inside the ranks of ``colossalai train --nproc N`` prints once: the first failing
rank's message on one line, not one traceback per rank plus torchrun's report."""

import io
import json
import os
import subprocess
import sys

from colossalai.cli.rank_errors import first_failure, split_launcher_noise


def test_rank_failure_prints_once(tmp_path):
    # A budget far too small passes the argument checks (Gemini alone knows its chunk sizes) and
    # makes every rank raise BudgetExceededError while setting up.
    argv = ["train", "--plugin", "gemini", "--device-budget", "1KiB", "--nproc", "2", "--steps", "2"]
    argv += ["--seq-len", "32", "--batch-size", "8", "--corpus-bytes", "100000", "--progress", "plain"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "colossalai.cli", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 1, proc
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("colossalai: rank ") and " of 2 failed: BudgetExceededError: need " in lines[0]
    folder = lines[1].rsplit(" ", 1)[1]
    first, failed = first_failure(folder)
    assert first.message in lines[0] and failed >= 1
    assert "Traceback (most recent call last)" in json.loads(first.path.read_text())["traceback"]


def test_first_failure_is_the_earliest(tmp_path):
    for rank, t in ((0, 5.0), (1, 2.0), (2, 2.0)):
        record = {"rank": rank, "time": t, "message": f"E{rank}", "traceback": ""}
        (tmp_path / f"rank{rank}.txt").write_text(json.dumps(record))
    (tmp_path / "rank9.txt").write_text("{trunc")  # a rank killed while writing: ignored
    first, failed = first_failure(tmp_path)
    assert (first.rank, first.message, failed) == (1, "E1", 3)
    (tmp_path / "empty").mkdir()
    assert first_failure(tmp_path / "empty") == (None, 0)


def test_launcher_noise_is_held_back():
    lines = [
        "a rank's warning\n",
        "W1203 07:45:00.123000 4242 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 1 closing signal SIGTERM\n",  # noqa: E501
        "another line from a rank\n",
        "Traceback (most recent call last):\n",
        '  File "torchrun", line 8\n',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
        "====\n",
    ]
    out = io.StringIO()
    held = split_launcher_noise(lines, out)
    assert out.getvalue() == "a rank's warning\nanother line from a rank\n"
    assert held == [lines[1], *lines[3:]]
