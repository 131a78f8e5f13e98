"""``colossal.planner`` against the real engines, and ``colossalai plan``.

The predicted peak of one rank (device + host: one allocator on a CPU-only machine) against
torch's own allocator events over a steady-state step, for DDP and ZeRO 1/2/3 with and without
offload, fp32 and bf16, with and without activation checkpointing, on 1 and 2 gloo ranks. The
full set (and step times) is ``packages/colossal-planner/bench/bench_validate_planner.py``.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

import colossal.comm as cc
from colossal.comm.testing import run_distributed
from colossal.planner import Layout, predict_memory, trace_model
from colossal.planner.trace import lm_loss
from colossal.testkit.memory import measure_allocations
from colossalai.cli.main import main
from colossalai.models import GPT, GPTConfig

B, T = 4, 64


def _cfg() -> GPTConfig:  # a fresh one: set_activation_checkpointing writes to the config
    return GPTConfig(n_layer=3, n_head=4, n_embd=64, vocab_size=256, block_size=T)


def _measure(cases: list[tuple[Layout, bool]]) -> list[int]:
    cc.ensure_process_group("test_plan")
    return [_measure_one(layout, ckpt) for layout, ckpt in cases]


def _measure_one(layout: Layout, ckpt: bool) -> int:
    """Peak of step 2, from a window opened before the model exists (everything of the run is in
    it, nothing of an earlier case is freed inside it: the function's locals die with it)."""
    torch.manual_seed(0)
    with measure_allocations() as (allocs, mark):
        model = GPT(_cfg())
        model.set_activation_checkpointing(ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if layout.engine == "ddp":
            module = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from colossal.zero import ZeroOptimizer

            module = model
            opt = ZeroOptimizer(opt, model, stage=layout.zero_stage, offload=layout.offload,
                                param_dtype=layout.precision, prefetch=layout.prefetch)  # fmt: skip
        x = torch.randint(0, 256, (B // layout.dp, T))
        for step in range(4):
            gc.collect()  # garbage cycles left by earlier steps (or set-up) are not the step's memory
            with mark(f"step{step}"):
                lm_loss(module(x), x).backward()
                opt.step()
                opt.zero_grad()
    return allocs.peak("step3")


def _predicted(layout: Layout, ckpt: bool) -> int:
    dtype = torch.float32 if layout.engine == "ddp" else layout.precision
    trace = trace_model(lambda: GPT(_cfg()), batch=B // layout.dp, seq=T, dtype=dtype, activation_checkpointing=ckpt)
    return predict_memory(trace, layout, device_type="cpu").breakdown["combined"]


ONE = [
    (Layout(engine="ddp"), False),
    (Layout(engine="ddp"), True),
    (Layout(engine="zero", zero_stage=1), False),
    (Layout(engine="zero", zero_stage=2, offload=True), False),
    (Layout(engine="zero", zero_stage=1, precision="bf16"), False),
    (Layout(engine="zero", zero_stage=3), False),
    (Layout(engine="zero", zero_stage=3, offload=True), True),
    (Layout(engine="zero", zero_stage=3, precision="bf16"), True),
    (Layout(engine="zero", zero_stage=3, prefetch=2), False),
]
TWO = [  # the two-rank cases whose measured peak does not depend on when Python's cycle collector runs
    (Layout(engine="zero", dp=2, zero_stage=1), False),
    (Layout(engine="zero", dp=2, zero_stage=1, offload=True), False),
    (Layout(engine="zero", dp=2, zero_stage=3), False),
]


@pytest.mark.timeout(300)
def test_predicted_peak_matches_the_engines():
    # one process group per case, as the bench does: a process's first collectives and engine set-up
    # allocate lazily (gloo, DDP's reducer), which a later case's window would not see again
    measured = [run_distributed(_measure, lay.dp, [(lay, ck)], timeout=120)[0][0] for lay, ck in ONE + TWO]
    errors = []
    for (layout, ckpt), got in zip(ONE + TWO, measured, strict=True):
        want = _predicted(layout, ckpt)
        errors.append((f"{layout.label}{' ckpt' if ckpt else ''}", (want - got) / got, layout.dp))
    # measured (bench_validate_planner.py): within 1.2% on one rank, 2% on two. ZeRO-2 and bf16 ZeRO-3
    # on two ranks measure one gradient bucket more or less from run to run (gc-dependent: always the
    # larger with gc disabled); those are in the bench, not here. On two ranks gloo's own timing still
    # moves a peak by a few percent (ZeRO-3 fp32: -5.6% in one of five runs): 8% there, 5% on one.
    bad = [(name, f"{100 * e:+.1f}%") for name, e, dp in errors if abs(e) > (0.05 if dp == 1 else 0.08)]
    assert not bad, bad


def test_plan_command_prints_the_best_layout(capsys):
    assert main(["plan", "--preset", "small", "--hardware", "rtx3090", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "GPT small" in out and "RTX 3090" in out
    assert "best: " in out and "colossalai train --nproc 1 --model gpt --preset small --vocab-size" in out
    assert "--no-activation-checkpointing" in out and "not calibrated" in out
    assert "booster = Booster(plugin=" in out


def test_plan_json_says_what_does_not_fit(capsys):
    # the seed's laptop: a 6 GiB RTX 2060 with 16 GiB of RAM, a 1.3 B GPT
    argv = ["plan", "--preset", "1.3b", "--hardware", "laptop-rtx2060", "--json", "--batch-size", "1",
            "--seq-len", "1024", "--activation-checkpointing"]  # fmt: skip
    assert main(argv) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["layouts"]}
    ddp = rows["ddp dp1 fp32"]
    assert not ddp["fits"] and "on the device, has 6.0 GiB" in ddp["shortfalls"][0]
    offload = rows["zero2+offload dp1 bf16"]  # fits the card, not the laptop's RAM
    assert not offload["fits"] and "of host memory per node, has 16.0 GiB" in offload["shortfalls"][0]
    disk = rows["gemini-auto+disk dp1 bf16"]
    assert disk["fits"] and disk["tiers"]["disk"] > 0 and "--disk-dir" in disk["command"]
    assert all(r["tiers"]["device"] > 0 for r in rows.values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hardware", "h10O"], "did you mean 'h100'"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--model", "no-such-model"], "--model must be one of"),
        (["--hardware", "dgx-h100", "--batch-size", "12"], "not divisible by the 8 devices"),
    ],
)
def test_plan_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_reads_a_hugging_face_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)  # fmt: skip
    cfg.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--hardware", "rtx3090", "--json", "--batch-size", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].startswith("llama") and out["seq"] == 128
    rows = {r["layout"]: r for r in out["layouts"]}
    assert rows["ddp dp1 fp32"]["fits"] and rows["ddp dp1 fp32"]["command"] is None  # train runs built-in models
    assert "GeminiPlugin" in rows["gemini-auto dp1 bf16"]["booster_code"]
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch"}')
    assert main(["plan", "--model", str(tmp_path), "--hardware", "rtx3090"]) == 2
    assert "no-such-arch" in capsys.readouterr().err


GEMINI = [  # (layout, blocks): placements, precisions, a tight budget and the disk tier
    (Layout(engine="gemini", placement="static", offload_optim_frac=1.0, device_budget=64 << 20), 2),
    (Layout(engine="gemini", placement="auto", precision="bf16", device_budget=3250 << 10), 4),
    (
        Layout(
            engine="gemini", placement="auto", chunk_size=16384, disk=True, device_budget=4 << 20, host_budget=3 << 20
        ),
        2,
    ),  # fmt: skip
]


def _gemini_measure(layout: Layout, blocks: int) -> dict:
    """Gemini's own account of step 2-3 (GeminiStats) and its disk file, on one process."""
    import os
    import tempfile

    from colossal.gemini import GeminiDDP, GeminiOptimizer

    cc.ensure_process_group("test_plan")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=blocks, n_head=4, n_embd=64, vocab_size=256, block_size=T)
    with tempfile.TemporaryDirectory() as disk_dir:
        kw = dict(placement=layout.placement, device_memory_budget=layout.device_budget, chunk_size=layout.chunk_size,
                  mixed_precision=None if layout.precision == torch.float32 else layout.precision,
                  offload_optim_frac=layout.offload_optim_frac)  # fmt: skip
        if layout.disk:
            kw.update(disk_dir=disk_dir, host_memory_budget=layout.host_budget)
        gem = GeminiDDP(GPT(cfg), **kw)
        opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-3), gem)
        x = torch.randint(0, 256, (B, T))
        for _ in range(4):
            opt.backward(lm_loss(gem(x), x))
            opt.step()
        m = gem.manager
        return {
            "device": max(s.peak_device_bytes for s in gem.stats_history[2:4]),
            "disk": os.fstat(m.disk.fd).st_size if m.disk is not None else 0,
        }


@pytest.mark.timeout(300)
def test_predicted_gemini_tiers_match_its_own_account():
    for layout, blocks in GEMINI:
        got = run_distributed(_gemini_measure, 1, layout, blocks, timeout=120)[0]
        cfg = GPTConfig(n_layer=blocks, n_head=4, n_embd=64, vocab_size=256, block_size=T)
        trace = trace_model(lambda cfg=cfg: GPT(cfg), batch=B, seq=T, dtype=layout.precision)
        pred = predict_memory(trace, layout, device_type="cpu")
        # bench/validate_gemini.py: device within 0.3% on every case, the disk file exact
        assert abs(pred.tiers.device - got["device"]) <= 0.01 * got["device"], (layout.label, pred.tiers, got)
        assert pred.tiers.disk == got["disk"], (layout.label, pred.tiers.disk, got)
