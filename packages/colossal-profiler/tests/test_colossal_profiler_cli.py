"""``colossal-profiler summarize DIR`` prints per-rank and merged tables."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from profiler_helpers import FakeSource, ManualClock, chunk_move_event, memory_sample, scripted_step, tiny_mlp

from colossal.profiler import Profiler, load_summaries
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


class _Wrapper(torch.nn.Module):
    """Holds the user's model as its only child ``module``, like DDP and GeminiDDP."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def test_summarize_shows_phases_memory_moves_and_modules(tmp_path, capsys):
    """#31 item 8: what the JSONL holds is in the tables too; module paths (and ``module_depth``)
    count from the user's model inside two wrapper levels (DDP inside a Booster wrapper)."""
    clock, gemini = ManualClock(start=10.0), FakeSource("colossal.gemini")
    model = _Wrapper(_Wrapper(tiny_mlp(clock)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, opt, clock=clock, sources=[gemini], discover=False, module_depth=1,
                  module_backward=True, out_dir=str(tmp_path)) as prof:  # fmt: skip
        out = model(torch.randn(3, 8))
        gemini.emit(memory_sample(10.5, "cuda", 3 << 20, 1 << 20, "after_fwd"))
        gemini.emit(chunk_move_event(1, 1 << 20, "cpu", "cuda", 10.1, 10.3, "prefetch"))
        gemini.emit(chunk_move_event(2, 1 << 20, "cpu", "cuda", 10.3, 10.4, "prefetch"))
        gemini.emit(chunk_move_event(1, 1 << 20, "cuda", "cpu", 10.6, 10.7, "evict"))
        out.sum().backward()
        opt.step()
        prof.step()
    assert main(["summarize", str(tmp_path), "--top", "2"]) == 0
    text = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ")}  # fmt: skip
    assert "recorded steps: 0" in text
    phases = text.split("## Phases")[1].splitlines()[1]
    assert phases.split("|")[2:5] == [" forward_ms ", " backward_ms ", " optimizer_ms "], phases
    memory = text.split("## Peak memory")[1].split("##")[0]
    assert "| 0    | cuda | 4        |" in memory, memory  # the published sample: 3 + 1 MiB
    assert rows["cpu -> cuda"] == ["cpu -> cuda", "prefetch", "2", "2.097", "300"]
    assert rows["cuda -> cpu"] == ["cuda -> cpu", "evict", "1", "1.049", "100"]
    modules = text.split("## Modules")[1].split("##")[0]
    names = [line.split("|")[1].strip() for line in modules.splitlines() if line.startswith("| ")][1:]
    # the user's names at depth 1 (no "module." level), top 2 of 3: "1" ran 1 s forward + 1 s backward
    assert names == ["1", "0"], modules
    assert capsys.readouterr().err == ""


def test_summarize_rejects_a_bad_top(tmp_path, capsys):
    _two_ranks(tmp_path)
    with pytest.raises(SystemExit):
        main(["summarize", str(tmp_path), "--top", "0"])
    assert "must be an int >= 1, got '0'" in capsys.readouterr().err
