"""The Chrome/Perfetto trace: parses, spans nest per (pid, tid), async pairs match, counters exist."""

import gzip
import json
from collections import defaultdict

import pytest
import torch
from profiler_helpers import scripted_step

from colossal.profiler import ChunkMove, MemoryPoint, Profiler, Schedule, Span, StepRecord, trace_events


def _load(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _assert_nested(events):
    by_track = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in by_track.items():
        stack = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1][1], f"{name} [{start}, {end}) crosses {stack[-1]} on {track}"
            stack.append((start, end, name))
    return by_track


def test_trace_file_parses_and_nests(tmp_path):
    prof, *_ = scripted_step(out_dir=str(tmp_path))
    events = _load(tmp_path / "trace.rank0.cycle0.json.gz")
    by_track = _assert_nested(events)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"steps", "phases", "modules", "modules_backward", "comm"}
    assert {n for *_, n in by_track[(0, 1)]} == {"forward", "backward", "optimizer"}
    (step,) = by_track[(0, 0)]
    assert step == (0.0, 8e6, "step 0")  # µs since the profiler started at t = 100 s
    (ar,) = [e for e in events if e["ph"] == "X" and e["name"] == "all_reduce"]
    assert ar["ts"] == 2.5e6 and ar["dur"] == 1e6 and ar["args"]["bytes"] == 4000
    assert ar["args"]["busbw_GBps"] == 6000.0 / 1e9
    begin = [e for e in events if e["ph"] == "b"]
    end = [e for e in events if e["ph"] == "e"]
    assert [(e["name"], e["id"]) for e in begin] == [(e["name"], e["id"]) for e in end] == [("reduce_scatter", 1)]
    assert begin[0]["ts"] == 4e6 and end[0]["ts"] == 6.5e6


def test_module_spans_nest_on_a_deeper_model(tmp_path):
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU())) for _ in range(3)]
    )
    with Profiler(model, out_dir=str(tmp_path), module_depth=3, discover=False) as prof:
        model(torch.randn(2, 4)).sum().backward()
    events = _load(tmp_path / "trace.rank0.cycle0.json.gz")
    by_track = _assert_nested(events)
    assert len(by_track[(0, 2)]) == 3 * 4  # i, i.0, i.1, i.1.0 per block
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all(set(e["args"]) == {"model", "non_model"} for e in counters)
    assert prof.steps[0].memory[0].model_bytes == 3 * (16 + 4) * 4


def test_chunk_moves_and_tier_counters():
    rec = StepRecord(step=0, start=0.0, end=1.0)
    rec.spans.append(Span("forward", "phases", 0.1, 0.9))
    rec.moves += [
        ChunkMove(3, 1024, "cpu", "cuda", 0.2, 0.5, "prefetch"),
        ChunkMove(4, 2048, "cuda", "cpu", 0.3, 0.4, "evict"),
    ]
    rec.memory += [MemoryPoint(0.25, "cuda", 100, 50, "x", "colossal.gemini")]
    events = trace_events([rec], rank=3, origin=0.0)
    pairs = [(e["ph"], e["name"], e["id"]) for e in events if e["ph"] in "be"]
    assert sorted(pairs) == sorted(
        [
            ("b", "chunk cpu->cuda", 1),
            ("e", "chunk cpu->cuda", 1),
            ("b", "chunk cuda->cpu", 2),
            ("e", "chunk cuda->cpu", 2),
        ]
    )
    (counter,) = [e for e in events if e["ph"] == "C"]
    assert counter == {
        "ph": "C",
        "name": "colossal.gemini memory cuda",
        "pid": 3,
        "ts": 0.25e6,
        "args": {"model": 100, "non_model": 50},
    }
    json.dumps(events)  # serialisable


class _MaybeRaise(torch.nn.Module):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("boom")
        return x


def test_one_trace_per_cycle_and_raising_forward(tmp_path):
    raiser = _MaybeRaise()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(raiser))
    schedule = Schedule(wait=1, active=2, repeat=2)
    with Profiler(model, out_dir=str(tmp_path), schedule=schedule, discover=False) as prof:
        for step in range(6):
            if step == 1:  # a forward raising inside a nested module leaves no open span behind
                raiser.fail = True
                with pytest.raises(RuntimeError, match="boom"):
                    model(torch.randn(2, 4))
                raiser.fail = False
            model(torch.randn(2, 4))
            prof.step()
    assert [r.step for r in prof.steps] == [1, 2, 4, 5]
    traces = sorted(p.name for p in tmp_path.glob("trace.*"))
    assert traces == ["trace.rank0.cycle0.json.gz", "trace.rank0.cycle1.json.gz"]
    for path in tmp_path.glob("trace.*"):
        _assert_nested(_load(path))
    assert [s.name for s in prof.steps[0].spans if s.track == "modules"] == ["0", "0", "1.0", "1"]
    assert [s.name for s in prof.steps[1].spans if s.track == "modules"] == ["0", "1.0", "1"]
