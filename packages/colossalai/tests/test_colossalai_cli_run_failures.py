"""``colossalai run`` (any script): a failure inside the ranks prints once, the first failing
rank's ``Type: message`` (with ``--debug``: its traceback, and the folder of every rank's kept),
not one traceback per rank plus torchrun's report; ``--max-restarts N`` restarts the workers as torchrun does."""

import os
import subprocess
import sys

from colossalai.cli.launcher import torchrun_command
from colossalai.cli.rank_errors import first_failure

FAILING = """
import os, pathlib, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} starts", flush=True)
pathlib.Path(f"started{rank}").touch()
if rank == 1:  # fail only once rank 0 has printed, so both lines must reach the output
    deadline = time.monotonic() + 120
    while not pathlib.Path("started0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError(f"bad value 7 on rank {rank}")
deadline = time.monotonic() + 120  # rank 0 fails after rank 1 (if torchrun has not stopped it yet)
while not pathlib.Path(os.environ["COLOSSALAI_CLI_ERRORS"], "rank1.txt").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
raise RuntimeError("rank 0 fails later")
"""

RESTARTED = """
import os, pathlib, sys
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and os.environ["RANK"] == "1":
    raise ValueError("first attempt fails")
pathlib.Path(f"done-rank{os.environ['RANK']}-attempt{attempt}").touch()
"""


def _run(tmp_path, script: str, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "job.py").write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "colossalai.cli", "run", "--nproc", "2", *flags, "job.py", "--flag"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)


def test_run_failure_prints_once(tmp_path):
    proc = _run(tmp_path, FAILING)
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [lines[0], lines[1]], proc.stderr
    assert lines[0] == "colossalai: rank 1 of 2 failed: ValueError: bad value 7 on rank 1", lines
    assert lines[1].endswith(" rank(s) failed; add --debug before the script for the traceback"), lines
    assert not list(tmp_path.glob("colossalai-errors-*")), "the traceback folder must be removed"
    assert "rank 0 starts" in proc.stdout and "rank 1 starts" in proc.stdout  # the script's output passes


def test_debug_prints_the_traceback_and_keeps_the_folder(tmp_path):
    proc = _run(tmp_path, FAILING, "--debug")
    assert proc.returncode == 1, proc
    assert proc.stderr.startswith("colossalai: rank 1 of 2 failed: ValueError: bad value 7 on rank 1\n")
    assert 'raise ValueError(f"bad value 7' in proc.stderr and "ChildFailedError" not in proc.stderr
    folder = proc.stderr.splitlines()[-1].rsplit(" ", 1)[1]
    assert folder.startswith(str(tmp_path)), proc.stderr
    first, failed = first_failure(folder)
    assert first.rank == 1 and 1 <= failed <= 2
    text = first.path.read_text()  # plain text: the header, a blank line, the lines Python prints
    assert text.startswith("rank: 1\n") and "\n\nTraceback (most recent call last):\n" in text
    assert '\n    raise ValueError(f"bad value 7 on rank {rank}")\n' in text


def test_max_restarts_restarts_the_workers(tmp_path):
    proc = _run(tmp_path, RESTARTED, "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    done = {p.name for p in tmp_path.glob("done-*")}  # rank 0 may also have finished attempt 0
    assert {"done-rank0-attempt1", "done-rank1-attempt1"} <= done and "done-rank1-attempt0" not in done, done


def test_torchrun_command_passes_max_restarts():
    cmd = torchrun_command(2, ["x.py"], max_restarts=3)
    assert cmd[cmd.index("--max-restarts") + 1] == "3"
    assert "--max-restarts" not in torchrun_command(2, ["x.py"])
