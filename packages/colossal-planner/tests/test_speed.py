"""The speed model's pieces against hand-computed values."""

from __future__ import annotations

import math

import pytest

from colossal.planner import Layout, comm_bytes, hardware_preset, predict_step_time, trace_model
from colossal.planner.speed import comm_calls
from colossal.testkit import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=32, n_embd=32, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def trace():
    return trace_model(lambda: GPT(CFG), batch=2, seq=32)


def test_matmul_rate_interpolates_the_curve_on_log_axes():
    hw = hardware_preset("rtx3090").with_(matmul_curve={"float32": [(1e3, 1e9), (1e5, 1e11)]})
    assert hw.matmul_rate("fp32", 10) == 1e9  # clamped below
    assert hw.matmul_rate("fp32", 1e9) == 1e11  # clamped above
    assert math.isclose(hw.matmul_rate("fp32", 1e4), 1e10, rel_tol=1e-12)  # geometric middle
    assert hw.matmul_rate("bf16", 1e4) == hw.flops("bf16")  # no curve: the peak
    assert hw.attention_rate("fp32", 1e4) == hw.matmul_rate("fp32", 1e4)  # no attention curve: the matmul one
    assert hardware_preset("rtx3090").from_dict(hw.to_dict()) == hw


def test_fused_attention_is_counted_and_flagged(trace):
    attn = [f for f, a in zip(trace.flops, trace.attention, strict=True) if a]
    assert len(attn) == 2 * CFG.n_layer  # one forward and one backward kernel per block
    b, h, t, d = 2, CFG.n_head, 32, CFG.n_embd // CFG.n_head
    assert attn[0] == 4 * b * h * t * t * d  # torch's sdpa formula: two (T x T) matmuls
    assert attn[-1] == 2.5 * attn[0]  # backward: five


def test_collectives_are_counted_per_call(trace):
    assert comm_calls(trace, Layout(engine="zero", zero_stage=3)) == []  # one rank: none
    grads = trace.trainable_numel * 4
    ddp = comm_calls(trace, Layout(engine="ddp", dp=4))
    assert ddp == [("all_reduce", grads)]  # one 25 MiB bucket
    z3 = comm_calls(trace, Layout(engine="zero", zero_stage=3, dp=4), buffers=3)
    ops = [op for op, _ in z3]
    assert ops.count("reduce_scatter") == 3 and ops.count("all_gather") == 5  # forward, backward, the root once
    assert ("all_reduce", 4) in z3  # the overflow flag
    assert comm_bytes(trace, Layout(engine="zero", zero_stage=1, dp=4), buffers=1)["reduce_scatter"] == grads


def test_engine_and_dispatch_costs_add_up(trace):
    hw = hardware_preset("rtx3090")
    lay = Layout(engine="zero", zero_stage=1)
    base = predict_step_time(trace, lay, hw, op_overhead=0.0)
    more = predict_step_time(trace, lay, hw, op_overhead=1e-5, engine_overhead=(1e-3, 1e-4))
    want = trace.ops * 1e-5 + 1e-3 + 1e-4 * len(trace.params)
    assert math.isclose(more.compute - base.compute, want, rel_tol=1e-9)
    # the optimizer's host loop on a CPU: ~10 operators per tensor it steps (one flat under ZeRO,
    # every parameter under DDP); CUDA's foreach loop costs the same for both
    cpu = hw.with_(device_type="cpu")
    ddp = predict_step_time(trace, Layout(engine="ddp"), cpu, op_overhead=1e-5)
    flat = predict_step_time(trace, lay, cpu, op_overhead=1e-5, n_step_tensors=1)
    cuda = [predict_step_time(trace, x, hw, op_overhead=1e-5).optimizer for x in (Layout(engine="ddp"), lay)]
    assert cuda[0] == pytest.approx(cuda[1])
    assert ddp.optimizer - flat.optimizer == pytest.approx(10 * (len(trace.params) - 1) * 1e-5, rel=0.05)
    with_host = predict_step_time(trace, Layout(engine="gemini"), hw, op_overhead=0.0, host_fraction=1.0)
    assert with_host.optimizer > predict_step_time(trace, Layout(engine="gemini"), hw, op_overhead=0.0).optimizer


def test_bad_layouts_and_curves_are_named(trace):
    from colossal.planner import Layout as L
    from colossal.planner import plan, predict_memory

    for kw, msg in [
        (dict(engine="zero", zero_stage=1, dp=True), "Layout.dp must be a positive int, got True"),
        (dict(engine="ddp", ddp_bucket_cap_mb=0), "Layout.ddp_bucket_cap_mb must be a positive int, got 0"),
        (dict(engine="gemini", chunk_size=0), "Layout.chunk_size must be a positive int or None, got 0"),
        (dict(engine="gemini", offload_optim_frac="0.5"), "Layout.offload_optim_frac must be in"),
        (dict(engine="gemini", device_budget=-1), "Layout.device_budget"),
    ]:
        with pytest.raises(ValueError, match=msg):
            L(**kw)
    assert L(engine="gemini", device_budget="2GiB").device_budget == 2 << 30  # as GeminiPlugin reads it
    hw = hardware_preset("rtx3090")
    with pytest.raises(ValueError, match="matmul_curve"):
        hw.with_(matmul_curve={"float32": [(0, -5)]})
    with pytest.raises(ValueError, match="needs 8 ranks, GeForce RTX 3090 24GB has 1 devices"):
        plan(trace, batch=8, seq=32, hardware=hw, layouts=[L(engine="zero", zero_stage=3, dp=8)])
    with pytest.raises(ValueError, match="the trace given is of batch=2, seq=32"):
        plan(trace, batch=8, seq=32, hardware=hw, layouts=[L(engine="zero", zero_stage=3)])
    with pytest.raises(ValueError, match="a Gemini layout needs a device budget"):
        predict_memory(trace, L(engine="gemini"), device_type="cuda")


def test_on_a_cpu_the_tiers_share_the_ram(trace):
    from colossal.planner import Layout as L
    from colossal.planner import plan

    cpu = hardware_preset("rtx3090").with_(device_type="cpu")
    lay = L(engine="zero", zero_stage=2, offload=True)
    (roomy,) = plan(trace, batch=2, seq=32, hardware=cpu, layouts=[lay])
    combined = roomy.memory.breakdown["combined"]
    ram = combined - 1  # one byte short of the device and host peaks together
    (short,) = plan(trace, batch=2, seq=32, hardware=cpu.with_(device_memory=ram, host_memory=ram), layouts=[lay])
    assert roomy.fits and not short.fits
    assert "of RAM per node (device and host tiers share it)" in short.shortfalls[0]
