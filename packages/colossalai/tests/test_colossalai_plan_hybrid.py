"""``colossal.planner``'s hybrid layouts against the real ``HybridParallelPlugin``.

The busiest rank's predicted peak (one allocator on a CPU-only machine: ``breakdown["combined"]``)
against torch's allocator events over a steady-state step, for 1D tensor,
pipeline (1F1B, GPipe, interleaved) and data parallelism (DDP, ZeRO-1) on 2 gloo ranks, fp32
(within 10%). The full set is ``packages/colossal-planner/bench/bench_validate_planner.py``.
"""

from __future__ import annotations

import gc

import torch

import colossal.comm as cc
from colossal.comm.testing import run_distributed
from colossal.planner import Layout, predict_memory, trace_model
from colossal.testkit.memory import measure_allocations
from colossalai.cli.plan_calibrate import build_engine
from colossalai.models import GPT, GPTConfig

B, T = 4, 48  # T differs from the width: nothing in the trace's rules may confuse the two

H = Layout
TWO = [
    (H(engine="hybrid", tp=2), 2),
    (H(engine="hybrid", pp=2, microbatches=2), 2),
    (H(engine="hybrid", pp=2, microbatches=4, pp_schedule="gpipe"), 2),
    (H(engine="hybrid", pp=2, microbatches=2, pp_schedule="interleaved", pp_virtual=2), 4),
    (H(engine="hybrid", dp=2, zero_stage=1), 2),
]
# sequence parallelism's measured peak moves between runs (ring 3.4 to 4.3 MiB, all-to-all 3.2 to 4.4);
# it, the
# 4-rank products (dp x tp, tp x pp, tp x sp, 2D) and ZB-H1 are in bench_validate_planner.py (dp x tp
# measured +8.6% to +13% between runs, 2D -25%, ZB-H1 -26%: not yet modelled closely)


def _cfg(n_layer: int) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, vocab_size=256, block_size=T)


def _measure(cases) -> list[int]:
    cc.ensure_process_group("test_plan_hybrid")
    return [_measure_one(layout, n_layer) for layout, n_layer in cases]


def _measure_one(layout: Layout, n_layer: int) -> int:
    """Peak of step 2, from a window opened before the model exists (the run's locals die with
    the function, so nothing of an earlier case is freed inside a later window)."""
    torch.manual_seed(0)
    gc.collect()
    with measure_allocations() as (allocs, mark):
        _, step = build_engine(GPT(_cfg(n_layer)), layout)
        x = torch.randint(0, 256, (B // layout.dp, T))
        for i in range(3):
            gc.collect()  # garbage cycles left by earlier steps (or set-up) are not the step's memory
            with mark(f"step{i}"):
                step(x)
    return allocs.peak("step2")


def _predicted(layout: Layout, n_layer: int) -> int:
    trace = trace_model(lambda: GPT(_cfg(n_layer)), batch=B // layout.dp // layout.microbatches, seq=T // layout.sp)
    return predict_memory(trace, layout).breakdown["combined"]


TOLERANCE = 0.10  # measured: -7.0% .. +7.4%


def test_hybrid_peaks_match_the_plugin():
    cases = TWO
    per_rank = run_distributed(_measure, 2, cases, timeout=300)
    report = []
    for i, (layout, n_layer) in enumerate(cases):
        measured = max(r[i] for r in per_rank)  # the busiest rank (the first pipeline stage, say)
        predicted = _predicted(layout, n_layer)
        report.append((layout.label, predicted, measured, (predicted - measured) / measured))
    bad = [r for r in report if abs(r[3]) > TOLERANCE]
    assert not bad, "\n".join(f"{n}: predicted {p}, measured {m} ({100 * e:+.1f}%)" for n, p, m, e in report)
