"""GPT training step through a 4-stage pipeline: ours against ``torch.distributed.pipelining``,
schedule by schedule, in one run on 4 gloo ranks.

Robust to a loaded machine: each schedule runs in one set of 4 processes holding both
implementations, whose steps alternate (torch first on even steps, ours first on odd ones), so
both see the same load; one warm-up step each is excluded (torch's first step costs ~1.3x), then
the median of ``--steps`` steps is reported. Prints per row: wall seconds per step (slowest rank)
and CPU seconds per step (all ranks), each with its ratio to torch's schedule of the same kind;
the peak bytes the allocator held during one step above its level at the step's start
(activations, gradients, transfer buffers; max over ranks); the peak live bytes beyond the
parameters, i.e. that plus what the implementation keeps allocated between steps (the net bytes
its warm-up step left: torch keeps a receive buffer per micro-batch and, on the last stage, the
outputs of the step; ours keeps nothing), max over ranks, with its ratio to torch; cores used
(CPU / wall); the measured bubble and the theoretical one, ``(p - 1) / (m + p - 1)`` (divided by
``v`` for interleaved: ``((p-1)/v) / (m + (p-1)/v)``); and the machine's load average before the
row.

Measured bubble: ``1 - CPU time / wall time`` per rank, averaged (the same for both
implementations; a rank waiting on a receive sleeps). For ours it also prints the idle fraction
from the executor's compute spans (``StepStats.bubble``). With 4 ranks on fewer cores a waiting
rank's core serves another rank, so the bubble shows in the cores used more than in wall time.
Writes JSON to ``$COLOSSAL_BENCH_OUT`` (default ``./bench-results``).

    python bench/bench_pipeline.py                    # 8 blocks, hidden 256, 8 micro-batches of 2
    python bench/bench_pipeline.py --steps 2 --seq 32 # reduced
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.pipeline import PipelineConfig, PipelineParallel

P = 4


class Block(nn.Module):
    """Pre-norm transformer block (causal attention + 4x MLP)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, n_blocks: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, max(1, h // 64)) for _ in range(n_blocks))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)


def embed(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    return m.wte(idx) + m.wpe(torch.arange(idx.shape[1]))


def head(m: GPT, x: torch.Tensor) -> torch.Tensor:
    return m.lm_head(m.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TorchChunk(nn.Module):
    """One pipeline stage for torch.distributed.pipelining: embed? + blocks[lo:hi] + head?"""

    def __init__(self, gpt: GPT, lo: int, hi: int) -> None:
        super().__init__()
        n = len(gpt.blocks)
        self.first, self.last = lo == 0, hi == n
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.wte, self.wpe = (gpt.wte, gpt.wpe) if self.first else (None, None)
        self.ln_f, self.lm_head = (gpt.ln_f, gpt.lm_head) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _torch_runner(kind: str, gpt: GPT, args, rank: int):
    from torch.distributed import pipelining as pl

    n = args.blocks
    v = 1 if kind in ("gpipe", "1f1b") else 2
    per = n // (P * v)
    if kind == "zbv":  # V placement: rank r holds stages r and 2P-1-r
        ids = [rank, 2 * P - 1 - rank]
    else:
        ids = [rank + k * P for k in range(v)]
    stages = [pl.PipelineStage(TorchChunk(gpt, s * per, (s + 1) * per), s, P * v, torch.device("cpu")) for s in ids]
    params = [p for st in stages for p in st.submod.parameters()]
    cls = {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved": pl.ScheduleInterleaved1F1B,
        "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
        "zbv": pl.ScheduleZBVZeroBubble,
    }[kind]
    sched = cls(stages[0] if v == 1 else stages, args.microbatches, loss_fn=lm_loss)
    has_first, has_last = any(s == 0 for s in ids), any(s == P * v - 1 for s in ids)

    def step(idx, tgt):
        losses = []
        sched.step(*((idx,) if has_first else ()), target=tgt if has_last else None, losses=losses)
        return None

    return step, params, None


def _ours_runner(kind: str, gpt: GPT, args, rank: int):
    v = 2 if kind == "interleaved" else 1
    pipe = PipelineParallel(
        gpt, PipelineConfig(num_microbatches=args.microbatches, schedule=kind, virtual=v), embed=embed, head=head
    )
    return (lambda idx, tgt: pipe.step(idx, tgt, lm_loss)), list(pipe.parameters()), pipe


FAMILIES = {  # our schedule -> torch's schedule of the same kind
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "interleaved",
    "zero_bubble": "interleaved_zb",
}


def _one_step(step, opt, idx, tgt) -> tuple[float, float]:
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step(idx, tgt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def _step_memory(step, opt, idx, tgt) -> tuple[int, int]:
    """(peak, net) bytes of one step from the profiler's CPU memory events: the most the allocator
    held above its level at the start of the step (activations, gradients, buffers in flight), and
    what the step left allocated at its end (on the warm-up step: buffers an implementation keeps
    between steps, such as torch's per-micro-batch receive buffers and last-stage outputs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _one_step(step, opt, idx, tgt)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return peak, level


def _rank(kind: str, args) -> dict:
    """Both implementations in the same processes, their steps alternating (which goes first
    alternates too), so both see the same machine load."""
    rank = dist.get_rank()
    runners = {}
    for impl, make, name in (("torch", _torch_runner, FAMILIES[kind]), ("ours", _ours_runner, kind)):
        torch.manual_seed(0)
        gpt = GPT(args.vocab, args.seq, args.hidden, args.blocks)
        step, params, pipe = make(name, gpt, args, rank)
        runners[impl] = (step, torch.optim.SGD(params, lr=1e-3), pipe)
    n_params = sum(p.numel() for p in gpt.parameters())
    g = torch.Generator().manual_seed(1)
    b = args.microbatches * args.mb_size
    data = [(torch.randint(0, args.vocab, (b, args.seq), generator=g),) * 2 for _ in range(args.steps + 1)]
    times = {impl: [] for impl in runners}
    held = {impl: _step_memory(step, opt, *data[0])[1] for impl, (step, opt, _) in runners.items()}  # warm-up
    for i, (idx, tgt) in enumerate(data[1:]):
        order = ("torch", "ours") if i % 2 == 0 else ("ours", "torch")
        for impl in order:
            step, opt, pipe = runners[impl]
            wall, cpu = _one_step(step, opt, idx, tgt)
            times[impl].append((wall, cpu, pipe.stats.bubble if pipe is not None else math.nan))
    # two profiled steps, the second measured: the profiler sees no free of a block allocated while
    # it was off (torch frees the previous step's last-stage outputs at the start of a step)
    peak = {impl: [_step_memory(s, o, *data[0]) for _ in range(2)][1][0] for impl, (s, o, _) in runners.items()}
    return {"times": times, "peak_bytes": peak, "held_bytes": held, "params": n_params}


def _theory(kind: str, m: int) -> float:
    v = 2 if kind in ("interleaved", "interleaved_zb", "zbv") else 1
    return ((P - 1) / v) / (m + (P - 1) / v)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated schedules to run (default: all)")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    results = []
    print(
        f"{P} gloo ranks, {os.cpu_count()} cores, {args.blocks} blocks, hidden {args.hidden}, seq {args.seq}, "
        f"{args.microbatches} micro-batches of {args.mb_size}; median of {args.steps} steps after one warm-up, "
        f"ours and torch alternating in the same processes"
    )
    cols = ("wall s", 7), ("ratio", 6), ("cpu s", 7), ("ratio", 6), ("peak MiB", 8), ("live MiB", 8), ("ratio", 6)
    cols += (("cores", 6),)
    cols += ("bubble", 7), ("spans", 6), ("theory", 7), ("load", 14)
    print(f"{'impl':6} {'schedule':15} " + " ".join(f"{c:>{w}}" for c, w in cols))
    for kind in FAMILIES:
        if only and kind not in only:
            continue
        load = _load()
        per_rank = run_distributed(_rank, P, kind, args, timeout=900)
        base = {}
        for impl, name in (("torch", FAMILIES[kind]), ("ours", kind)):
            steps = list(zip(*(r["times"][impl] for r in per_rank), strict=True))  # per step: every rank
            wall = statistics.median(max(s[0] for s in st) for st in steps)  # slowest rank
            cpu = statistics.median(sum(s[1] for s in st) for st in steps)  # all ranks
            bubble = statistics.median(sum(1 - s[1] / s[0] for s in st) / P for st in steps)
            spans = statistics.median(sum(s[2] for s in st) / P for st in steps)
            peak = max(r["peak_bytes"][impl] for r in per_rank) / 2**20
            live = max(r["peak_bytes"][impl] + r["held_bytes"][impl] for r in per_rank) / 2**20
            base.setdefault("wall", wall)
            base.setdefault("cpu", cpu)
            base.setdefault("live", live)
            row = {
                "impl": impl, "schedule": name, "wall_s_median": wall, "cpu_s_median": cpu,
                "wall_ratio_to_torch": wall / base["wall"], "cpu_ratio_to_torch": cpu / base["cpu"],
                "peak_step_mib_max": peak, "peak_live_mib_max": live, "live_ratio_to_torch": live / base["live"],
                "held_between_steps_mib": [r["held_bytes"][impl] / 2**20 for r in per_rank],
                "cores_used": cpu / wall, "bubble_cpu": bubble,
                "bubble_spans": spans, "bubble_theory": _theory(name, args.microbatches),
                "load_before": load, "params": per_rank[0]["params"],
            }  # fmt: skip
            results.append(row)
            print(
                f"{impl:6} {name:15} {wall:7.3f} {row['wall_ratio_to_torch']:6.2f} {cpu:7.3f} "
                f"{row['cpu_ratio_to_torch']:6.2f} {peak:8.1f} {live:8.1f} {row['live_ratio_to_torch']:6.2f} "
                f"{cpu / wall:6.2f} {bubble:7.3f} {spans:6.3f} "
                f"{row['bubble_theory']:7.3f} {load:>14}",
                flush=True,
            )
    path = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "pipeline.json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=2))
    print(f"\nwrote {path / 'pipeline.json'}")


if __name__ == "__main__":
    main()
