"""Gemini against plain PyTorch and colossal-zero stage 3 + CPU offload, under one device budget.

One process per configuration (a fresh interpreter each, so nothing leaks between them):

1. largest GPT (by parameters) trainable under ``--budget-mib`` with (a) plain PyTorch + AdamW,
   (b) colossal-zero stage 3 + static CPU offload, (c) Gemini static, (d) Gemini auto;
2. at the largest size Gemini auto trains: step time and bytes moved per step for (b)-(d) and
   the Belady optimum on the same trace and budget;
3. with a budget that holds everything, at every width: Gemini auto step time over plain PyTorch
   (hook overhead), fresh processes alternating plain/Gemini ``--repeat`` times, the median of each,
   wall time and process CPU time (on a shared machine other processes stretch wall time, not CPU time).

On a CPU-only machine the "device" is the CPU with an accounted budget. (a) and (b) keep no
accounting of their own: their device need is computed with the same rule Gemini accounts by
(model data on the device + peak non-model data measured by ``NonModelTracker`` in the same
process): (a) fp32 params + grads + Adam moments; (b) fp32 working params (1 rank keeps all of
them; gradients and optimizer states are offloaded). (c)/(d) are Gemini's own accounting, enforced.

    python packages/colossal-gemini/bench/bench_gemini.py --budget-mib 16 --widths 128 256 384 512
    python packages/colossal-gemini/bench/bench_gemini.py --roomy-only --layers 8 --steps 8 --repeat 5 \
        --widths 128 256 384 512 768
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

from colossal.testkit import GPT, GPTConfig, lm_loss  # the contract GPT of the tests (a bench sibling)

HERE = pathlib.Path(__file__).parent


def _cfg(width: int, layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=64, n_embd=width, n_layer=layers, n_head=4)


def _batches(n: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 256, (batch, seq), generator=g), torch.randint(0, 256, (batch, seq), generator=g))
        for _ in range(n)
    ]


def _non_model_peak(model, batch) -> int:
    from colossal.gemini import NonModelTracker

    keys = {p.untyped_storage()._cdata for p in model.parameters()}
    x, y = batch
    with NonModelTracker(lambda k: k in keys) as tracker:
        lm_loss(model(x), y).backward()
        peak = tracker.peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


def _timed(step, batches) -> tuple[float, float]:
    """Wall and process-CPU seconds per step, after 2 untimed steps."""
    for x, y in batches[:2]:  # warm-up (Gemini traces) and the first placed step (moves chunks into place)
        step(x, y)
    start, cpu = time.perf_counter(), time.process_time()
    for x, y in batches[2:]:
        step(x, y)
    n = len(batches) - 2
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def run_plain(args) -> dict:
    torch.manual_seed(0)
    model = GPT(_cfg(args.width, args.layers))
    n = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    batches = _batches(args.steps, args.batch, args.seq)
    need = 16 * n + _non_model_peak(model, batches[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    t, cpu = _timed(step, batches)
    return {"params": n, "device_need": need, "fits": need <= args.budget, "step_s": t, "step_cpu_s": cpu}


def run_zero(args) -> dict:
    import torch.distributed as dist

    try:
        import colossal.zero as zero
    except ImportError:
        return {"fits": None, "note": "n/a (colossal-zero not installed)"}
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(_cfg(args.width, args.layers))
    n = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    batches = _batches(args.steps, args.batch, args.seq)
    need = 4 * n + _non_model_peak(model, batches[0])
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=3, offload=True)
    moved = []
    handle = zero.register_observer(lambda e: moved.append(e.nbytes) if e.kind == "chunk_move" else None)

    def step(x, y):
        opt.backward(lm_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    t, _ = _timed(step, batches)
    handle.remove()
    return {
        "params": n,
        "device_need": need,
        "fits": need <= args.budget,
        "step_s": t,
        "bytes_per_step": sum(moved) // args.steps,
    }


def run_gemini(args) -> dict:
    from colossal.gemini import BudgetExceededError, GeminiDDP, GeminiOptimizer

    torch.manual_seed(0)
    model = GPT(_cfg(args.width, args.layers))
    n = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    batches = _batches(args.steps, args.batch, args.seq)
    extra = {"offload_param_frac": 1.0, "offload_optim_frac": 1.0} if args.placement == "static" else {}
    try:
        gem = GeminiDDP(model, placement=args.placement, device_memory_budget=args.budget, **extra)
        opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-3), gem)

        def step(x, y):
            opt.backward(lm_loss(gem(x), y))
            opt.step()

        t, cpu = _timed(step, batches)
    except BudgetExceededError as exc:
        return {"params": n, "fits": False, "note": str(exc)[:160]}
    s = gem.stats
    return {
        "params": n,
        "fits": s.peak_device_bytes <= args.budget,
        "step_s": t,
        "step_cpu_s": cpu,
        "bytes_per_step": s.bytes_moved,
        "belady_bytes": s.belady_bytes,
        "peak_device": s.peak_device_bytes,
        "model_states": 20 * n,
        "chunk_size": gem.manager.chunk_size,
        "chunks": len(gem.manager.chunks),
    }


def _worker(args) -> None:
    torch.set_num_threads(args.threads)
    fn = {"plain": run_plain, "zero": run_zero, "static": run_gemini, "auto": run_gemini}[args.placement]
    print("RESULT " + json.dumps(fn(args)))


def _spawn(kind: str, width: int, budget: int, args) -> dict:
    store = pathlib.Path(os.environ.get("TMPDIR", "/tmp"), f"gemini-bench-{os.getpid()}-{kind}-{width}")
    store.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--placement",
        kind,
        "--width",
        str(width),
        "--budget",
        str(budget),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--store",
        str(store),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"fits": False, "note": (out.stderr.strip().splitlines() or ["no result"])[-1][:160]}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-mib", type=float, default=16.0)
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 384, 512])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--roomy-width", type=int, default=0, help="hook-overhead run at this width only")
    p.add_argument("--repeat", type=int, default=3, help="alternating repeats of the hook-overhead runs (median)")
    p.add_argument("--roomy-only", action="store_true", help="only the hook-overhead comparison")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--placement", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 3:
        p.error(f"--steps must be at least 3 (the first 2 are warm-up and not timed), got {args.steps}")
    if args.worker:
        return _worker(args)
    budget = int(args.budget_mib * 2**20)
    kinds = {
        "plain": "(a) PyTorch+AdamW",
        "zero": "(b) ZeRO-3+offload",
        "static": "(c) Gemini static",
        "auto": "(d) Gemini auto",
    }
    if args.roomy_only:
        return _report({k: {} for k in kinds}, kinds, budget, args)
    results = {k: {w: _spawn(k, w, budget, args) for w in args.widths} for k in kinds}
    _report(results, kinds, budget, args)


def _report(results, kinds, budget, args) -> None:
    print(f"\nbudget {budget / 2**20:.1f} MiB, GPT n_layer={args.layers}, batch {args.batch}x{args.seq}")
    print(f"{'config':22s} {'largest params':>15s} {'model states/budget':>20s}")
    largest = {}
    for k, label in kinds.items():
        if not results[k]:
            continue
        ok = [(r["params"], w) for w, r in results[k].items() if r.get("fits")]
        largest[k] = max(ok) if ok else (0, None)
        ratio = 20 * largest[k][0] / budget  # params + grads + Adam states in fp32 (+ fp32 master for Gemini)
        print(f"{label:22s} {largest[k][0]:>15,d} {ratio:>19.1f}x")
    w = largest.get("auto", (0, None))[1]
    if w is not None:
        print(f"\nat width {w} ({largest['auto'][0]:,d} params): step time and bytes moved per step")
        for k in ("zero", "static", "auto"):
            r = results[k][w]
            if r.get("fits") or "bytes_per_step" in r:
                t, mib = r.get("step_s", float("nan")), r.get("bytes_per_step", 0) / 2**20
                print(f"{kinds[k]:22s} {t:8.3f} s  {mib:10.2f} MiB")
            else:
                print(f"{kinds[k]:22s} {'n/a':>8s}    ({r.get('note', 'does not fit')})")
        r = results["auto"][w]
        print(
            f"{'Belady optimum':22s} {'':8s}    {r['belady_bytes'] / 2**20:10.2f} MiB  "
            f"(auto/optimum = {r['bytes_per_step'] / max(r['belady_bytes'], 1):.2f})"
        )
    roomy = _roomy(args)
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gemini.json").write_text(
        json.dumps({"budget": budget, "args": vars(args), "results": results, "roomy": roomy}, indent=1, default=str)
    )


def _roomy(args) -> dict:
    """Hook overhead: Gemini auto vs plain PyTorch with a budget that holds everything, per width."""
    widths = [args.roomy_width] if args.roomy_width else args.widths
    print(
        f"\nbudget holding everything (n_layer={args.layers}, batch {args.batch}x{args.seq}, {args.steps - 2} timed "
        f"steps): median of {args.repeat} alternating fresh processes each"
    )
    print(f"{'width':>6s} {'params':>12s} {'plain ms':>9s} {'gemini ms':>10s} {'wall ratio':>11s} {'cpu ratio':>10s}")
    table = {}
    for w in widths:
        runs = [(k, _spawn(k, w, 2**40, args)) for _ in range(args.repeat) for k in ("plain", "auto")]  # alternate
        med = {
            k: {m: statistics.median(r[m] for kk, r in runs if kk == k) for m in ("step_s", "step_cpu_s")}
            for k in ("plain", "auto")
        }
        wall = med["auto"]["step_s"] / med["plain"]["step_s"]
        cpu = med["auto"]["step_cpu_s"] / med["plain"]["step_cpu_s"]
        params = runs[0][1]["params"]
        print(
            f"{w:>6d} {params:>12,d} {med['plain']['step_s'] * 1e3:>9.1f} {med['auto']['step_s'] * 1e3:>10.1f} "
            f"{wall:>10.2f}x {cpu:>9.2f}x"
        )
        table[w] = {"params": params, "median": med, "wall_ratio": wall, "cpu_ratio": cpu}
    return table


if __name__ == "__main__":
    main()
