"""Profiler overhead on a small GPT training step: off, counters, full trace (ratios in one run).

Modes, each against the plain step (no profiler) measured in the same run, interleaved round by
round so that machine noise hits every mode alike. Both wall time and process CPU time are
reported: on a shared CPU machine the CPU-time ratios are the stable ones (other processes
stretch wall time but not our CPU time); on a GPU the wall-time ratios are what matter.

* ``off``      -- ``Profiler(enabled=False)``: nothing attached, ``step()`` counts;
* ``counters`` -- comm + memory + phase spans, per-step figures in memory, no files;
* ``full``     -- also module spans (depth 2) with memory samples at module boundaries, and every
  step written out: Chrome trace, TensorBoard scalars/tables, JSONL summary.

Run: ``python packages/colossal-profiler/bench/bench_overhead.py [--rounds 9 --steps 10]``.
Writes ``$COLOSSAL_BENCH_OUT/colossal-profiler-overhead.json`` (default ``./bench-results``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal.profiler import Profiler, Schedule
from colossal.testkit import GPT, GPTConfig  # the contract GPT of the tests (a bench sibling)


# ---- the measurement ------------------------------------------------------------------------------
def _profiler(mode: str, model: nn.Module, opt: torch.optim.Optimizer, out_dir: str, tokens: int):
    if mode == "plain":
        return contextlib.nullcontext(None)
    if mode == "off":
        return Profiler(model, opt, enabled=False)
    every = Schedule(active=1, repeat=0)  # every step recorded
    if mode == "counters":
        return Profiler(
            model,
            opt,
            schedule=every,
            modules=False,
            trace=False,
            tensorboard=False,
            summary=False,
            tokens_per_step=tokens,
        )
    # one cycle of all the run's steps: trace, TensorBoard and JSONL written when the run ends
    cycle = Schedule(active=10**9, repeat=1)
    return Profiler(model, opt, schedule=cycle, out_dir=out_dir, module_depth=2, tokens_per_step=tokens)


def _run(mode: str, model, opt, batch, steps: int, out_dir: str) -> tuple[float, float]:
    """Wall and process-CPU seconds per step of ``steps`` steps under ``mode`` (writing outputs included)."""
    idx, targets = batch
    start, cpu_start = time.perf_counter(), time.process_time()
    with _profiler(mode, model, opt, out_dir, idx.numel()) as prof:
        for _ in range(steps):
            logits = model(idx)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if prof is not None:
                prof.step()
        if idx.is_cuda:
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=args.n_embd, n_layer=args.n_layer, n_head=4)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device)
    batch = (idx, torch.roll(idx, -1, dims=1))
    modes = ("plain", "off", "counters", "full")
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as out_dir:
        for mode in modes:  # warm-up: first-call effects, lazy imports of the event sources
            _run(mode, model, opt, batch, 2, out_dir)
        for _ in range(args.rounds):
            for mode in modes:
                runs[mode].append(_run(mode, model, opt, batch, args.steps, out_dir))
    result = {
        "device": str(device), "torch": torch.__version__, "config": dataclasses.asdict(cfg), "batch": args.batch,
        "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps,
    }  # fmt: skip
    for i, clock in enumerate(("wall", "cpu")):
        for stat, fn in (("median", statistics.median), ("min", min)):
            per_step = {m: fn(r[i] for r in runs[m]) for m in modes}
            result[f"{clock}_seconds_per_step_{stat}"] = per_step
            result[f"{clock}_ratio_vs_plain_{stat}"] = {m: per_step[m] / per_step["plain"] for m in modes[1:]}
        print(f"{clock} time, device {device}: {args.rounds} rounds x {args.steps} steps; ratio vs plain (median, min)")
        for mode in modes:
            med, low = result[f"{clock}_seconds_per_step_median"][mode], result[f"{clock}_seconds_per_step_min"][mode]
            ratios = (
                "" if mode == "plain" else f"   ratio {med / result[f'{clock}_seconds_per_step_median']['plain']:.4f}"
            )
            ratios += "" if mode == "plain" else f", {low / result[f'{clock}_seconds_per_step_min']['plain']:.4f}"
            print(f"  {mode:9s} {med * 1e3:8.2f} ms/step (min {low * 1e3:.2f}){ratios}")
    added = _added_cost_per_step(args.rounds)
    result["added_cpu_seconds_per_step_tiny_model"] = added
    plain = result["cpu_seconds_per_step_median"]["plain"]
    for mode, cost in added.items():
        print(
            f"  {mode}: adds {cost * 1e6:.0f} us CPU per step on a 1-layer model"
            f" = {cost / plain * 100:.2f}% of this GPT step"
        )
    off_cost = _off_step_cost()
    result["off_step_call_seconds"] = off_cost
    result["off_step_call_fraction"] = off_cost / result["cpu_seconds_per_step_median"]["plain"]
    print(f"off: prof.step() costs {off_cost * 1e9:.0f} ns = {result['off_step_call_fraction'] * 100:.5f}% of a step")
    out = os.environ.get("COLOSSAL_BENCH_OUT", "bench-results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "colossal-profiler-overhead.json"), "w") as f:
        json.dump(result, f, indent=2)


def _added_cost_per_step(rounds: int, steps: int = 50) -> dict[str, float]:
    """CPU seconds a profiler mode adds per step, measured on a 1-layer model whose step is short,
    so the profiler's own per-step work is a large, measurable part of it (module spans: 1)."""
    model = nn.Sequential(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.zeros(1, 8)
    tiny = (idx, None)
    cost: dict[str, list[float]] = {m: [] for m in ("plain", "counters", "full")}
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(rounds):
            for mode in cost:
                cost[mode].append(_run_tiny(mode, model, opt, tiny, steps, out_dir))
    med = {m: statistics.median(v) for m, v in cost.items()}
    return {m: med[m] - med["plain"] for m in ("counters", "full")}


def _run_tiny(mode: str, model, opt, batch, steps: int, out_dir: str) -> float:
    x = batch[0]
    start = time.process_time()
    with _profiler(mode, model, opt, out_dir, 1) as prof:
        for _ in range(steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if prof is not None:
                prof.step()
    return (time.process_time() - start) / steps


def _off_step_cost(n: int = 200_000) -> float:
    """Seconds per ``step()`` of a disabled profiler (the only thing ``off`` adds to a step)."""
    prof = Profiler(enabled=False)
    with prof:
        start = time.perf_counter()
        for _ in range(n):
            prof.step()
        return (time.perf_counter() - start) / n


if __name__ == "__main__":
    main()
