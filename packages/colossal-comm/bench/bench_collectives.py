"""colossal.comm against raw torch.distributed: the cost of the wrapper, in one run.

For each op and size, on N gloo ranks: raw ``torch.distributed`` call, ``colossal.comm`` with no
observer, and ``colossal.comm`` with a ``CommCounter`` registered. Prints time ratios against
raw torch (1.00 = no overhead) and writes JSON to ``$COLOSSAL_BENCH_OUT`` (default
``bench-results/``).

    python packages/colossal-comm/bench/bench_collectives.py --nproc 2
"""

import argparse
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import run_distributed


def _time(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _cases(x: torch.Tensor, out: torch.Tensor) -> dict:
    return {
        "all_reduce": (lambda: dist.all_reduce(x), lambda: cc.all_reduce(x)),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(out, x), lambda: cc.reduce_scatter(x)),
    }


def measure(sizes: list[int], iters: int) -> list[dict]:
    n, rows = dist.get_world_size(), []
    for numel in sizes:
        x = torch.ones(numel // n * n)
        for op, (raw, ours) in _cases(x, torch.empty(x.numel() // n)).items():
            t_raw, t_ours = _time(raw, iters), _time(ours, iters)
            with cc.CommCounter():
                t_obs = _time(ours, iters)
            rows.append({"op": op, "numel": numel, "torch_s": t_raw, "colossal_s": t_ours, "observed_s": t_obs})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="256,65536,4194304", help="element counts (fp32)")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    rows = run_distributed(measure, args.nproc, [int(s) for s in args.sizes.split(",")], args.iters, timeout=1800)[0]
    print(f"{'op':<15}{'numel':>10}{'torch(us)':>11}{'ours/torch':>12}{'observed/torch':>16}")
    for r in rows:
        print(
            f"{r['op']:<15}{r['numel']:>10}{r['torch_s'] * 1e6:>11.1f}"
            f"{r['colossal_s'] / r['torch_s']:>12.3f}{r['observed_s'] / r['torch_s']:>16.3f}"
        )
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "colossal-comm-collectives.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
