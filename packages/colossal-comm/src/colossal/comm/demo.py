"""Bus-bandwidth demo: ``python -m colossal.comm.demo --nproc 4``.

Launches N local processes (gloo on CPU, NCCL when CUDA is present and ``--backend nccl``),
builds a one-axis mesh and prints, per collective and message size, the time and the
nccl-tests bandwidths: ``algbw = size / time`` and ``busbw = algbw * bus_factor(op, n)``
(all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all ``(n-1)/n``; broadcast 1).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from colossal.comm import collectives as C
from colossal.comm.events import bus_factor
from colossal.comm.mesh import Mesh
from colossal.comm.testing import run_distributed

__all__ = ["OPS", "measure", "format_table", "main"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _one_call(op: str, buf: torch.Tensor, group) -> None:
    if op == "all_reduce":
        C.all_reduce(buf, group=group)
    elif op == "all_gather":  # message size = output size: each rank contributes size / n
        C.all_gather(buf[: buf.numel() // dist.get_world_size(group)], group=group)
    elif op == "reduce_scatter":
        C.reduce_scatter(buf, group=group)
    elif op == "all_to_all":
        C.all_to_all(buf, group=group)
    elif op == "broadcast":
        C.broadcast(buf, src=0, group=group)
    else:
        raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def measure(ops: list[str], sizes: list[int], iters: int, warmup: int) -> list[dict]:
    """Run on every rank; returns rows (op, bytes, seconds per call = slowest rank's mean)."""
    mesh = Mesh(axes={"world": -1})
    group, n = mesh.group("world"), mesh.size("world")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4 // n * n)  # fp32, divisible by n
            buf = torch.ones(numel, device=device)
            for _ in range(warmup):
                _one_call(op, buf, group)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                _one_call(op, buf, group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rows.append({"op": op, "bytes": numel * 4, "seconds": elapsed.item(), "n": n})
    return rows


def format_table(rows: list[dict]) -> str:
    """nccl-tests style table: size, time (us), algbw and busbw (GB/s)."""
    lines = [f"{'op':<15}{'size':>12}{'time(us)':>12}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"]
    for r in rows:
        algbw = r["bytes"] / r["seconds"] / 1e9
        busbw = algbw * bus_factor(r["op"], r["n"])
        lines.append(f"{r['op']:<15}{r['bytes']:>12}{r['seconds'] * 1e6:>12.1f}{algbw:>13.3f}{busbw:>13.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the measurement on ``--nproc`` local ranks, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="number of local processes")
    p.add_argument("--sizes", default="4K,64K,1M,16M", help="comma-separated message sizes (bytes, K/M/G)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    rows = run_distributed(
        measure, args.nproc, ops, sizes, args.iters, args.warmup, timeout=args.timeout, backend=args.backend
    )[0]
    print(f"# colossal.comm bus bandwidth: {args.nproc} ranks, backend {args.backend}, fp32")
    print(format_table(rows))


if __name__ == "__main__":
    main()
