"""Opt-in module backward spans: nested on their own track, inside the backward phase."""

import torch
from profiler_helpers import ManualClock, tiny_mlp

from colossal.profiler import Profiler, trace_events


def test_backward_module_spans_exact_and_nested():
    clock = ManualClock(start=100.0)
    model = tiny_mlp(clock)  # each Advancing Linear advances the clock 1 s in forward and in backward
    with Profiler(model, clock=clock, discover=False, memory=False, module_backward=True) as prof:
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    spans = {s.name: (s.start, s.end) for s in prof.steps[0].spans if s.track == "modules_backward"}
    phases = {s.name: (s.start, s.end) for s in prof.steps[0].spans if s.track == "phases"}
    assert phases["backward"] == (102.0, 104.0)
    # backward runs last module first: "1.1" (Linear 16->4) during [102, 103), then "0" during [103, 104)
    assert spans["1.1"] == (102.0, 103.0) and spans["1"] == (102.0, 103.0) and spans["0"] == (103.0, 104.0)
    assert spans["2"] == (102.0, 102.0)
    events = [e for e in trace_events(prof.steps, 0, 100.0) if e["ph"] == "X" and e["tid"] == 3]
    assert len(events) == len(spans)
    assert prof.summaries[0]["modules_backward"]["0"]["time"] == 1.0


def test_off_by_default_and_removed_after():
    model = tiny_mlp()
    with Profiler(model, discover=False) as prof:
        model(torch.randn(3, 8)).sum().backward()
        assert not any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())
    assert not [s for s in prof.steps[0].spans if s.track == "modules_backward"]
    with Profiler(model, discover=False, module_backward=True):
        assert any(m._backward_hooks for m in model.modules())
    assert not any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())
