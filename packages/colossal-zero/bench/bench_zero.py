"""colossal.zero against torch DDP, ZeroRedundancyOptimizer and FSDP2 (``fully_shard``), in one run.

Same GPT, same per-rank batch, AdamW fp32, N gloo ranks with 1 thread each (each variant in fresh
processes so peak RSS is its own). Prints step time and per-rank peak RSS, ratios against FSDP2
and DDP, and each engine's model-state bytes; writes JSON to ``$COLOSSAL_BENCH_OUT``
(default ``bench-results/``). Defaults are the issue's 46M-parameter configuration::

    python packages/colossal-zero/bench/bench_zero.py
    python packages/colossal-zero/bench/bench_zero.py --n-layer 4 --n-embd 256 --vocab 4096 --steps 3
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

from colossal.comm.testing import preload, run_distributed
from colossal.testkit import GPT, Block, GPTConfig  # the contract GPT of the tests (bench sibling)

preload("colossal.optim", "colossal.zero")

VARIANTS = [
    "ddp", "torch_zero", "fsdp2", "zero1", "zero2", "zero3", "zero1_overlap", "zero2_overlap",
    "zero1_offload", "zero2_offload", "zero3_offload",
]  # fmt: skip


def _build(variant: str, cfg: GPTConfig, lr: float):
    """(model to call, step function(loss), model-state bytes or None)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant in ("ddp", "torch_zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = (
            torch.optim.AdamW(model.parameters(), lr=lr)
            if variant == "ddp"
            else ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        )
        return ddp, _plain_step(opt), None
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model.modules():
            if isinstance(m, Block):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, _plain_step(torch.optim.AdamW(model.parameters(), lr=lr)), None
    from colossal.optim import HybridAdam
    from colossal.zero import ZeroOptimizer

    stage, offload = int(variant[4]), variant.endswith("offload")
    opt = HybridAdam(model.parameters(), lr=lr) if offload else torch.optim.AdamW(model.parameters(), lr=lr)
    overlap = variant.endswith("overlap")  # overlap_param_gather: gathers waited in the next forward
    zero = ZeroOptimizer(opt, model, stage=stage, offload=offload, bucket_numel=2**24, overlap_param_gather=overlap)
    return model, _zero_step(zero), zero


def _plain_step(opt):
    def step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _zero_step(zero):
    def step(loss):
        zero.backward(loss)
        zero.step()
        zero.zero_grad()

    return step


def run_variant(variant: str, cfg_kw: dict, batch: int, steps: int, lr: float) -> dict:
    cfg = GPTConfig(**cfg_kw)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process before the model
    model, step, zero = _build(variant, cfg, lr)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for i in range(steps + 1):  # the first step (allocations, lazy optimizer state) is not timed
        data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        logits = model(data[:, :-1])  # (B, T, V)
        step(F.cross_entropy(logits.reshape(-1, cfg.vocab_size), data[:, 1:].reshape(-1)))
        if i:
            times.append(time.perf_counter() - start)
    t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "variant": variant,
        "step_s": t.item(),
        "peak_rss": rss,
        "base_rss": base,
        "model_state": zero.memory_stats() if zero else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="bytes; >0 fixes glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_) for every rank of every "
        "variant, so freed large buffers go back to the OS instead of fragmenting the heap (0: glibc default)",
    )
    args = p.parse_args()
    if args.mmap_threshold > 0:  # read by glibc when the forkserver starts (before the first run)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    cfg = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab, block_size=args.seq)
    psi = sum(x.numel() for x in GPT(GPTConfig(**cfg)).parameters())
    print(f"GPT {psi / 1e6:.1f}M params, {args.nproc} gloo ranks x 1 thread, batch {args.batch}x{args.seq}")
    rows = []
    for v in args.variants.split(","):
        per_rank = run_distributed(run_variant, args.nproc, v, cfg, args.batch, args.steps, 1e-4, timeout=3600)
        peak = max(r["peak_rss"] for r in per_rank)
        rows.append(
            per_rank[0] | {"peak_rss": peak, "peak_rss_delta": max(r["peak_rss"] - r["base_rss"] for r in per_rank)}
        )
    _report(rows, vars(args) | {"params": psi})


def _report(rows: list[dict], meta: dict) -> None:
    by = {r["variant"]: r for r in rows}
    print(f"{'variant':<15}{'s/step':>9}{'vs FSDP2':>10}{'vs DDP':>9}{'peak RSS GiB':>14}{'RSS growth GiB':>16}"
          f"{'model states GiB':>18}")  # fmt: skip
    for r in rows:
        ratio = {k: r["step_s"] / by[k]["step_s"] if k in by else float("nan") for k in ("fsdp2", "ddp")}
        ms = r["model_state"]["total"] / 2**30 if r["model_state"] else float("nan")
        print(
            f"{r['variant']:<15}{r['step_s']:>9.3f}{ratio['fsdp2']:>10.2f}{ratio['ddp']:>9.2f}"
            f"{r['peak_rss'] / 2**30:>14.2f}{r['peak_rss_delta'] / 2**30:>16.2f}{ms:>18.3f}"
        )
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_zero.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out / 'bench_zero.json'}")


if __name__ == "__main__":
    main()
