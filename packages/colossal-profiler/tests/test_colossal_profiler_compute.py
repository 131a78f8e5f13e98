"""Compute: FLOPs per module and per step, and our spans inside torch.profiler traces."""

import torch

from colossal.profiler import Profiler


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_flops_per_module_and_step():
    model = _model()
    with Profiler(model, flops=True, discover=False, tokens_per_step=5, peak_flops=1e12) as prof:
        model(torch.randn(5, 8)).sum().backward()
    spans = {s.name: s for s in prof.steps[0].spans if s.track == "modules"}
    # Linear forward on (B, in) -> (B, out): 2 * B * in * out FLOPs
    assert spans["0"].args["flops"] == 2 * 5 * 8 * 16 and spans["2"].args["flops"] == 2 * 5 * 16 * 4
    assert spans["1"].args["flops"] == 0
    assert spans["0"].args["flops_per_s"] == spans["0"].args["flops"] / spans["0"].duration
    # backward: grad wrt input (not for the first layer, whose input needs none) and weight
    forward = 2 * 5 * (8 * 16 + 16 * 4)
    backward = 2 * 5 * 8 * 16 + 2 * (2 * 5 * 16 * 4)
    f = prof.figures[0]
    assert f.flops == forward + backward
    assert f.mfu == f.flops_per_s / 1e12 and f.tokens_per_s == 5 / f.step_time


def test_spans_show_in_torch_profiler():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        with Profiler(model, opt, discover=False) as prof:
            with prof.phase("data"):
                x = torch.randn(2, 8)
            model(x).sum().backward()
            opt.step()
    names = {e.key for e in tp.key_averages()}
    for expected in (
        "phases::data",
        "phases::forward",
        "phases::backward",
        "phases::optimizer",
        "modules::0",
        "modules::2",
    ):
        assert f"colossal.profiler::{expected}" in names, expected


def test_phase_is_free_when_not_recording():
    prof = Profiler(enabled=False)
    with prof.phase("data"):
        pass
    assert prof.steps == []
