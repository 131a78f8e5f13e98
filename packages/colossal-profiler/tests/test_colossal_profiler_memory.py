"""Memory: model/non-model split, optimizer states, Gemini/ZeRO-style events per tier, chunk moves."""

import torch
from profiler_helpers import FakeSource, ManualClock, chunk_move_event, memory_sample, tiny_mlp

from colossal.profiler import Profiler, model_bytes


def test_model_bytes_counts_params_grads_and_optimizer_states():
    model = tiny_mlp()
    opt = torch.optim.Adam(model.parameters())
    n_params = (8 * 16 + 16) + (16 * 4 + 4)
    assert model_bytes(model.parameters(), opt) == 4 * n_params
    model(torch.randn(2, 8)).sum().backward()
    assert model_bytes(model.parameters(), opt) == 4 * 2 * n_params
    opt.step()  # Adam: exp_avg, exp_avg_sq (+ a scalar step tensor per parameter)
    assert model_bytes(model.parameters(), opt) == 4 * 4 * n_params + 4 * 4


def test_samples_across_the_step_see_grads_and_states_appear():
    model = tiny_mlp()
    opt = torch.optim.Adam(model.parameters())
    with Profiler(model, opt, discover=False) as prof:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    points = {p.label: p for p in prof.steps[0].memory}
    n = 4 * ((8 * 16 + 16) + (16 * 4 + 4))
    assert points["step:start"].model_bytes == points["forward:end"].model_bytes == n
    assert points["backward:end"].model_bytes == 2 * n
    assert points["optimizer:end"].model_bytes == 4 * n + 4 * 4
    assert all(p.tier == "cpu" and p.non_model_bytes > 0 for p in points.values())
    assert prof.figures[0].peak_memory >= 4 * n


def test_gemini_like_events_per_tier():
    clock, gemini = ManualClock(start=5.0), FakeSource("colossal.gemini")
    with Profiler(clock=clock, sources=[gemini], discover=False) as prof:
        gemini.emit(memory_sample(5.0, "cuda", 1000, 200, "after_fwd"))
        gemini.emit(memory_sample(5.5, "cpu", 3000, 0, "after_fwd"))
        gemini.emit(chunk_move_event(7, 512, "cpu", "cuda", 5.1, 5.2, "prefetch"))
        gemini.emit(object())  # unknown events are ignored
    rec = prof.steps[0]
    tiers = {(p.tier, p.source): (p.model_bytes, p.non_model_bytes) for p in rec.memory if p.source != "sampler"}
    assert tiers == {("cuda", "colossal.gemini"): (1000, 200), ("cpu", "colossal.gemini"): (3000, 0)}
    (move,) = rec.moves
    assert (move.chunk_id, move.nbytes, move.src, move.dst, move.reason) == (7, 512, "cpu", "cuda", "prefetch")
    assert prof.summaries[0]["chunk_move_bytes"] == 512
    assert prof.summaries[0]["peak_memory_by_tier"]["cpu"] >= 3000
    assert gemini.observers == []


def test_memory_off_ignores_memory_events():
    gemini = FakeSource("colossal.gemini")
    with Profiler(sources=[gemini], discover=False, memory=False) as prof:
        gemini.emit(memory_sample(5.0, "cuda", 1000, 200, "x"))
        gemini.emit(chunk_move_event(7, 512, "cpu", "cuda", 5.1, 5.2, "prefetch"))
    assert prof.steps == []  # nothing recorded: the empty final step is dropped
