"""``colossal-profiler summarize DIR`` prints per-rank and merged tables."""

import json
import pathlib
import subprocess
import sys

from profiler_helpers import scripted_step

from colossal.profiler import load_summaries
from colossal.profiler.cli import main


def _two_ranks(tmp_path):
    scripted_step(out_dir=str(tmp_path))
    lines = (tmp_path / "summary.rank0.jsonl").read_text().splitlines()
    other = json.loads(lines[0])
    other.update(rank=1, step_time=other["step_time"] * 2)
    (tmp_path / "summary.rank1.jsonl").write_text(json.dumps(other) + "\n")


def test_summarize_merges_ranks(tmp_path, capsys):
    _two_ranks(tmp_path)
    assert sorted(load_summaries(str(tmp_path))) == [0, 1]
    assert main(["summarize", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## Per rank" in out and "slowest rank: 1" in out
    assert "| 0    | 1     | 8000" in out and "| 1    | 1     | 1.6e+04" in out  # step_time in ms
    # merged by op: both ranks' all_reduce (4000 B each, 1 s each) -> 8000 B, 2000 ms
    (row,) = [line for line in out.splitlines() if line.startswith("| all_reduce")]
    assert [c.strip() for c in row.strip("|").split("|")][:4] == ["all_reduce", "2", "8000", "2000"]


def test_missing_dir_is_an_error(tmp_path, capsys):
    assert main(["summarize", str(tmp_path)]) == 2
    assert "no summary.rank" in capsys.readouterr().err


def test_console_script(tmp_path):
    _two_ranks(tmp_path)
    # The interpreter under test, never the first ``python`` / ``colossal-profiler`` on PATH: the
    # console script of this environment sits next to it (when the package is installed).
    exe = pathlib.Path(sys.executable).with_name("colossal-profiler")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "colossal.profiler.cli"]
    out = subprocess.run([*cmd, "summarize", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "Communication by call site" in out
