"""Whole-stack benchmark: the GPT trained with every colossalai plugin on 2 processes, against
plain PyTorch DDP and FSDP2 loops (no Booster) measured in the same run.

Prints tokens/s (and the ratio to plain DDP) and peak memory per rank, and writes JSON to
``$COLOSSAL_BENCH_OUT`` (default ``./bench-results``). Peak memory: ``max_memory_allocated`` on
CUDA, the process's peak resident set on CPU (each configuration runs in fresh processes).

    python packages/colossalai/bench/bench_colossalai_stack.py --preset small --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONFIGS = {
    "torch-ddp": None,
    "torch-fsdp2": None,
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "zero1": ("zero", {"stage": 1}),
    "zero2": ("zero", {"stage": 2}),
    "zero3": ("zero", {"stage": 3}),
    "gemini": ("gemini", {"device_memory_budget": 1 << 30}),
    "hybrid-tp2": ("hybrid", {"tp_size": 2}),
}


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _batches(n, batch, seq, device):
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randint(0, 256, (batch, seq + 1), generator=g)).to(device) for _ in range(n)]


def _plain(kind, model, device):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model.to(device)
    if kind == "torch-ddp":
        return DDP(model), model
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, model


def _rank(name, preset, steps, batch, seq):
    from colossal.comm import default_device
    from colossalai import Booster
    from colossalai.booster.registry import make_plugin
    from colossalai.models import build_gpt

    device = default_device()
    model = build_gpt(preset, seed=0, block_size=seq)
    if CONFIGS[name] is None:
        model, _ = _plain(name, model, device)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = lambda x, y: (_loss(model(x), y).backward(), optim.step(), optim.zero_grad())
    else:
        plugin_name, kwargs = CONFIGS[name]
        booster = Booster(plugin=make_plugin(plugin_name, **kwargs))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optim, *_ = booster.boost(model, optim)
        step = lambda x, y: (booster.backward(_loss(model(x), y), optim), optim.step(), optim.zero_grad())
    data = _batches(steps + 2, batch, seq, device)
    for b in data[:2]:  # warm-up (Gemini traces its first iteration)
        step(b[:, :-1], b[:, 1:])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for b in data[2:]:
        step(b[:, :-1], b[:, 1:])
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"seconds": seconds, "peak_bytes": peak}


def main() -> None:
    from colossal.comm.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small" if torch.cuda.is_available() else "mini")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="per-rank sequences per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    args = p.parse_args()
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    rows = {}
    for name in args.configs.split(","):
        res = run_distributed(_rank, 2, name, args.preset, args.steps, args.batch_size, args.seq_len, timeout=1800,
                              backend=backend, threads=max(1, (os.cpu_count() or 2) // 2))  # fmt: skip
        dp = 1 if name.startswith("hybrid") else 2
        tokens = args.steps * args.batch_size * args.seq_len * dp
        rows[name] = {
            "tokens_per_s": tokens / max(r["seconds"] for r in res),
            "peak_bytes_per_rank": max(r["peak_bytes"] for r in res),
        }
    base = rows.get("torch-ddp", next(iter(rows.values())))["tokens_per_s"]
    print(f"colossalai whole stack: GPT {args.preset}, 2 processes ({backend}), {args.steps} steps, "
          f"batch {args.batch_size}x{args.seq_len} per rank")  # fmt: skip
    print(f"{'config':<12} {'tokens/s':>12} {'vs torch-ddp':>13} {'peak MiB/rank':>14}")
    for name, r in rows.items():
        ratio = r["tokens_per_s"] / base
        print(f"{name:<12} {r['tokens_per_s']:>12,.0f} {ratio:>12.2f}x {r['peak_bytes_per_rank'] / 2**20:>14,.1f}")
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"preset": args.preset, "steps": args.steps, "batch": args.batch_size, "seq": args.seq_len}
    (out / "colossalai_stack.json").write_text(
        json.dumps({"config": meta, "backend": backend, "results": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
