"""GPT training step through a 4-stage pipeline: ours against ``torch.distributed.pipelining``,
schedule by schedule, in one run on 4 gloo ranks.

Each (implementation, schedule) runs in fresh processes: one warm-up step (excluded: torch's
first step costs ~1.3x), then ``--steps`` timed steps. Prints per row: seconds per step (slowest
rank) and the ratio to torch's schedule of the same kind, peak RSS per rank (max over ranks),
cores used (summed CPU time of all ranks / wall time), the measured bubble and the theoretical
one, ``(p - 1) / (m + p - 1)`` (divided by ``v`` for interleaved: ``((p-1)/v) / (m + (p-1)/v)``).

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
import resource
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


def _rank(impl: str, kind: str, args) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    gpt = GPT(args.vocab, args.seq, args.hidden, args.blocks)
    n_params = sum(p.numel() for p in gpt.parameters())
    step, params, pipe = (_ours_runner if impl == "ours" else _torch_runner)(kind, gpt, args, rank)
    opt = torch.optim.SGD(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    b = args.microbatches * args.mb_size
    data = [(torch.randint(0, args.vocab, (b, args.seq), generator=g),) * 2 for _ in range(args.steps + 1)]
    spans = []
    for i, (idx, tgt) in enumerate(data):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step(idx, tgt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i > 0:  # the first step is warm-up
            spans.append((wall, cpu, pipe.stats.bubble if pipe is not None else math.nan))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    n = len(spans)
    return {
        "wall": sum(s[0] for s in spans) / n,
        "cpu": sum(s[1] for s in spans) / n,
        "span_bubble": sum(s[2] for s in spans) / n,
        "rss_mib": rss,
        "params": n_params,
    }


def _theory(kind: str, m: int) -> float:
    v = 2 if kind in ("interleaved", "interleaved_zb", "zbv") else 1
    return ((P - 1) / v) / (m + (P - 1) / v)


ROWS = [
    ("torch", "gpipe", "gpipe"),
    ("ours", "gpipe", "gpipe"),
    ("torch", "1f1b", "1f1b"),
    ("ours", "1f1b", "1f1b"),
    ("torch", "interleaved", "interleaved"),
    ("ours", "interleaved", "interleaved"),
    ("torch", "interleaved_zb", "zero_bubble"),
    ("torch", "zbv", "zero_bubble"),
    ("ours", "zero_bubble", "zero_bubble"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated schedules to run (default: all)")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    results, base = [], {}
    print(
        f"{P} gloo ranks, {os.cpu_count()} cores, {args.blocks} blocks, hidden {args.hidden}, seq {args.seq}, "
        f"{args.microbatches} micro-batches of {args.mb_size}"
    )
    cols = ("s/step", 7), ("vs torch", 8), ("RSS MiB", 8), ("cores", 6), ("bubble", 7), ("spans", 6), ("theory", 7)
    print(f"{'impl':6} {'schedule':15} " + " ".join(f"{c:>{w}}" for c, w in cols))
    for impl, kind, family in ROWS:
        if only and kind not in only:
            continue
        per_rank = run_distributed(_rank, P, impl, kind, args, timeout=900)
        wall = max(r["wall"] for r in per_rank)
        cores = sum(r["cpu"] for r in per_rank) / wall
        bubble = sum(1 - r["cpu"] / r["wall"] for r in per_rank) / P
        spans = sum(r["span_bubble"] for r in per_rank) / P
        row = {
            "impl": impl,
            "schedule": kind,
            "s_per_step": wall,
            "rss_mib_max": max(r["rss_mib"] for r in per_rank),
            "cores_used": cores,
            "bubble_cpu": bubble,
            "bubble_spans": spans,
            "bubble_theory": _theory(kind, args.microbatches),
            "params": per_rank[0]["params"],
        }
        if impl == "torch":
            base.setdefault(family, wall)
        row["ratio_to_torch"] = wall / base[family] if family in base else math.nan
        results.append(row)
        print(
            f"{impl:6} {kind:15} {wall:7.3f} {row['ratio_to_torch']:8.2f} {row['rss_mib_max']:8.0f} {cores:6.2f} "
            f"{bubble:7.3f} {spans:6.3f} {row['bubble_theory']:7.3f}",
            flush=True,
        )
    path = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "pipeline.json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=2))
    print(f"\nwrote {path / 'pipeline.json'}")


if __name__ == "__main__":
    main()
