"""Gemini with frozen parameters (a LoRA model), as the planner restates it: frozen chunks packed apart,
working data only (no master, gradient or state), no gradient buffer, trainable-only optimizer and disk
plans, frozen modules' backward operators and the chunks they hold. The last test runs the engine itself
(skipped where ``colossal.gemini`` is not installed: the planner does not depend on it)."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from colossal.planner.gemini import gemini_memory, gemini_operator_needs, plan_chunks
from colossal.planner.layout import Layout
from colossal.planner.memory import predict_memory
from colossal.planner.trace import lm_loss, trace_model
from colossal.testkit import GPT, GPTConfig, add_adapters

RANK, BATCH, SEQ = 4, 2, 16


def lora_gpt() -> nn.Module:
    """The testkit GPT (C = 32, 2 blocks) frozen, adapters on q/v, the (tied) head trainable."""
    model = add_adapters(GPT(GPTConfig(block_size=SEQ)), RANK)
    model.lm_head.requires_grad_(True)  # tied to wte: both train
    return model


@pytest.fixture(scope="module")
def traces():
    return {dt: trace_model(lora_gpt, batch=BATCH, seq=SEQ, dtype=dt) for dt in (torch.float32, torch.bfloat16)}


def _layout(**kw) -> Layout:
    return Layout(engine="gemini", **kw)


def test_frozen_and_trainable_parameters_are_packed_apart(traces):
    trace = traces[torch.float32]
    plan = plan_chunks(trace, _layout(chunk_size=8192))
    grads = [p.requires_grad for p in trace.params]
    for idx, frozen in zip(plan.chunks, plan.frozen, strict=True):
        assert {grads[i] for i in idx} == {not frozen}  # never mixed
    assert [idx[0] for idx in plan.chunks] == sorted(idx[0] for idx in plan.chunks)  # by first parameter
    trainable = [p.numel for p in trace.params if p.requires_grad]
    assert sum(plan.used(c) for c in plan.trainable) == sum(trainable) == trace.trainable_numel
    assert all(plan.block_bytes(c, 0, 2) == 0 for c in range(len(plan.chunks)) if plan.is_frozen(c))


def test_frozen_chunks_cost_their_working_shard_only(traces):
    """One rank, every block on the host (static): the host holds every working shard, and masters,
    gradients and states of the trainable chunks only; bf16 halves the frozen bytes."""
    for dt in (torch.float32, torch.bfloat16):
        lay = _layout(placement="static", offload_optim_frac=1.0, chunk_size=8192, precision=dt)
        tiers, parts = gemini_memory(traces[dt], lay, device_memory=1 << 30)
        plan = plan_chunks(traces[dt], lay)
        n_train = len(plan.trainable)
        assert parts["optimizer_blocks"] == sum(8 * 8192 + 8 * plan.used(c) for c in plan.trainable)
        assert tiers.host == parts["chunks"] + parts["optimizer_blocks"] and n_train < parts["n_chunks"]
        assert parts["chunks"] == parts["n_chunks"] * 8192 * dt.itemsize


def test_frozen_modules_run_backward_operators_without_gradients(traces):
    labels = [label for label, _ in gemini_operator_needs(traces[torch.float32], _layout(chunk_size=8192))]
    bwd = [lab.removeprefix("bwd:") for lab in labels if lab.startswith("bwd:")]
    # the frozen base's input needs a gradient (wte trains): its operators run, in reverse forward order
    block = ["mlp.fc_out", "mlp.fc_in", "ln_2", "attn.out_proj", "attn.v_proj.lora_b", "attn.v_proj.lora_a"]
    block += ["attn.v_proj.base", "attn.k_proj", "attn.q_proj.lora_b", "attn.q_proj.lora_a", "attn.q_proj.base"]
    expect = ["wte(tied head)", "ln_f"] + [f"blocks.{b}.{m}" for b in (1, 0) for m in block + ["ln_1"]] + ["wte"]
    assert bwd == expect  # wpe (token positions in, no gradient) has none
    assert "fwd:wpe" in labels


def test_disk_plan_homes_blocks_of_trainable_chunks_only(traces):
    kw = dict(placement="static", chunk_size=8192, disk=True, offload_param_frac=1.0, disk_param_frac=0.5)
    kw.update(disk_grad_frac=0.5, disk_optim_frac=1.0)
    trace = traces[torch.float32]
    plan = plan_chunks(trace, _layout(**kw))
    n, train = len(plan.chunks), plan.trainable
    shards = n - round(0.5 * n)  # the last half of all chunks
    k = len(train)
    masters, grads = train[k - round(0.5 * k) :], train[k - round(0.5 * k) :]
    aliased = len(set(masters) & set(range(shards, n)))  # fp32: a disk-homed master is its shard's region
    want = 8192 * 4 * ((n - shards) - aliased + len(masters) + len(grads) + 2 * k)
    assert gemini_memory(trace, _layout(**kw), device_memory=1 << 30)[0].disk == want


def test_predict_memory_plans_a_frozen_model_under_gemini(traces):
    mem = predict_memory(traces[torch.float32], _layout(placement="auto", chunk_size=8192), device_memory=1 << 30)
    assert mem.breakdown["optimizer_tensors"] == mem.breakdown["n_trainable_chunks"] < mem.breakdown["n_chunks"]


ENGINE_CASES = [
    dict(placement="static", offload_optim_frac=0.0, chunk_size=8192, device_budget=64 << 20),
    dict(placement="static", offload_param_frac=0.5, precision=torch.bfloat16, chunk_size=8192, device_budget=1 << 20),
    dict(placement="auto", precision=torch.bfloat16, chunk_size=8192, device_budget=400_000),
    dict(placement="auto", chunk_size=8192, device_budget=420_000),
    dict(
        placement="static",
        chunk_size=8192,
        disk=True,
        offload_param_frac=1.0,
        disk_param_frac=0.5,
        device_budget=1 << 20,
    ),
    dict(
        placement="auto",
        precision=torch.bfloat16,
        chunk_size=8192,
        disk=True,
        device_budget=400_000,
        host_budget=600_000,
    ),
]


def _measure(layout: Layout, disk_dir: str) -> dict[str, int]:
    from colossal.gemini import GeminiDDP, GeminiOptimizer

    kw = dict(placement=layout.placement, device_memory_budget=layout.device_budget, chunk_size=layout.chunk_size)
    kw.update(mixed_precision=None if layout.precision == torch.float32 else layout.precision)
    kw.update(offload_param_frac=layout.offload_param_frac, offload_optim_frac=layout.offload_optim_frac)
    if layout.disk:
        kw.update(disk_dir=disk_dir, host_memory_budget=layout.host_budget)
        if layout.placement == "static":
            kw.update(disk_param_frac=layout.disk_param_frac, disk_grad_frac=layout.disk_grad_frac)
            kw.update(disk_optim_frac=layout.disk_optim_frac)
    torch.manual_seed(0)
    gem = GeminiDDP(lora_gpt(), **kw)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-3), gem)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        opt.backward(lm_loss(gem(x), x))
        opt.step()
    m = gem.manager
    disk = __import__("os").fstat(m.disk.fd).st_size if m.disk is not None else 0
    device = max(s.peak_device_bytes for s in gem.stats_history[2:4])
    return {"device": device, "host": m.host.peak_bytes, "disk": disk, "n_chunks": len(m.chunks)}


@pytest.mark.parametrize(
    "case", ENGINE_CASES, ids=lambda c: f"{c['placement']}-{c.get('precision', 'fp32')}-{c.get('disk', False)}"
)
def test_prediction_matches_the_engine_on_a_lora_model(traces, case):
    pytest.importorskip("colossal.gemini")
    layout = _layout(**case)
    tiers, parts = gemini_memory(traces[layout.precision], layout, device_memory=1 << 30)
    with tempfile.TemporaryDirectory(prefix="planner-frozen-") as d:
        got = _measure(layout, d)
    assert parts["fits"] == 1 and got["n_chunks"] == parts["n_chunks"]
    assert tiers.device == pytest.approx(got["device"], rel=0.01)
    assert tiers.disk == got["disk"]
    if not layout.disk:
        assert tiers.host_total == pytest.approx(got["host"], rel=0.01)
        return
    # the disk tier's I/O pool is predicted at its bound ([Note: what is approximated]): with one or two
    # streamed blocks the engine's pool stays up to three fp32 buffers below it
    assert got["host"] <= tiers.host_total <= got["host"] + 3 * (4 * 8192 + 4096) + 4096
