"""A failure inside the ranks of ``colossalai train --nproc N`` prints once: the first failing
rank's message on one line (in the CLI's words for a user's error), not one traceback per rank
plus torchrun's report; the records are plain text, in a folder removed at the end."""

import io
import os
import subprocess
import sys

from colossalai.cli.rank_errors import first_failure, record_failure, split_launcher_noise

ARGV = ["train", "--plugin", "gemini", "--device-budget", "1KiB", "--nproc", "2", "--steps", "2"]
ARGV += ["--seq-len", "32", "--batch-size", "8", "--corpus-bytes", "100000", "--progress", "plain"]


def test_rank_failure_prints_once_in_cli_words(tmp_path):
    # A budget far too small passes the argument checks (Gemini alone knows its chunk sizes) and
    # makes every rank raise BudgetExceededError while setting up.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "colossalai.cli", *ARGV]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("colossalai train: error: --device-budget 1KiB is too small: need "), lines
    assert "raise --device-budget to at least " in lines[0], lines
    assert "chunk_size" not in lines[0] and "device_memory_budget" not in lines[0], lines
    assert not list(tmp_path.glob("colossalai-errors-*")), "the traceback folder must be removed"


def test_first_failure_is_the_earliest(tmp_path):
    for rank, t in ((0, 5.0), (1, 2.0), (2, 2.0)):
        record = f"rank: {rank}\nattempt: 0\ntime: {t}\nmessage: E{rank}\n\nTraceback (most recent call last):\n"
        (tmp_path / f"rank{rank}.txt").write_text(record)
    (tmp_path / "rank9.txt").write_text("rank: 9\nti")  # a rank killed while writing: ignored
    first, failed = first_failure(tmp_path)
    assert (first.rank, first.message, failed) == (1, "E1", 3)
    assert first.traceback == "Traceback (most recent call last):\n" and first.cli == ""
    (tmp_path / "empty").mkdir()
    assert first_failure(tmp_path / "empty") == (None, 0)


def test_record_is_plain_text(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    try:
        raise ValueError("bad\nvalue")
    except ValueError as exc:
        record_failure(exc, tmp_path, cli="--lr is bad")
    first, failed = first_failure(tmp_path)
    assert (first.rank, first.message, first.cli, failed) == (3, "ValueError: bad value", "--lr is bad", 1)
    head = (tmp_path / "rank3.txt").read_text().split("\n\n", 1)[0].splitlines()
    assert [line.split(": ", 1)[0] for line in head] == ["rank", "attempt", "time", "message", "cli"]
    assert first.traceback.startswith("Traceback (most recent call last):\n  File ")


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
