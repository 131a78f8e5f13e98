"""One MoE layer forward+backward: ours against DeepSpeed's ``deepspeed.moe.layer.MoE`` and a dense
MLP with the same active parameters, on 1, 2 and 4 gloo ranks (expert parallelism = world size).

Speed: all implementations are built in the same ranks and run in turn, step after step (so a
busy shared machine slows them alike); milliseconds per step are the median over ``--steps``
after one warm-up, of the slowest rank. Memory: peak RSS (``VmHWM``) of fresh rank processes per
row that build one implementation and run two steps. All-to-all bytes per step are counted by
wrapping ``torch.distributed.all_to_all_single``, which both implementations call. ``DS/ours``
is DeepSpeed's step time over the row's (above 1: faster than DeepSpeed); on one rank the
dropless layer is also compared with the dense MLP. Writes JSON to ``$COLOSSAL_BENCH_OUT``
(default ``./bench-results``).

    python bench/bench_moe.py                                   # hidden 512, 8 experts, 4096 tokens/rank
    python bench/bench_moe.py --tokens 512 --hidden 128 --steps 2 --worlds 2   # quick

DeepSpeed is optional (``bench/requirements.txt``); its rows are skipped when it is missing. It
runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) with groups made by hand through
``set_deepspeed_parallelism()`` (no DeepSpeed engine).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.moe import MoE, MoEConfig, expert_groups


def _peak_rss_mib() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _count_a2a() -> list[int]:
    """Wrap ``dist.all_to_all_single`` to add each call's input bytes to the returned counter."""
    total, inner = [0], dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        total[0] += input.numel() * input.element_size()
        return inner(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    return total


def _build(impl: str, k: int, args, ep: int):
    """The module and a function ``x -> loss`` for one row."""
    c, f, e = args.hidden, 4 * args.hidden, args.experts
    torch.manual_seed(0)
    if impl == "dense":  # same active parameters: k experts' worth of width
        mlp = nn.Sequential(nn.Linear(c, k * f), nn.GELU(approximate="tanh"), nn.Linear(k * f, c))
        return mlp, lambda x: mlp(x).square().mean()
    if impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed.moe.layer import MoE as DSMoE

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        expert = nn.Sequential(nn.Linear(c, f), nn.GELU(approximate="tanh"), nn.Linear(f, c))
        moe = DSMoE(hidden_size=c, expert=expert, num_experts=e, ep_size=ep, k=k, capacity_factor=1.0, min_capacity=4)
        moe.set_deepspeed_parallelism()

        def loss(x):
            out, l_aux, _ = moe(x)
            return out.square().mean() + 0.01 * l_aux

        return moe, loss
    cf = None if impl == "ours-dropless" else 1.0
    cfg = MoEConfig(hidden=c, ffn_hidden=f, num_experts=e, top_k=k, capacity_factor=cf, z_loss_coef=0.0)
    moe = MoE(cfg, expert_groups(ep).ep if ep > 1 else None)
    return moe, lambda x: moe(x).square().mean() + moe.aux_loss


def _timed(module, loss_fn, x, a2a) -> tuple[float, float, int]:
    """One forward+backward: (wall seconds, CPU seconds of this rank's process, all-to-all bytes).

    CPU time is what the step costs this rank whatever else the machine runs (time waiting for
    peers or for a core is not in it), so on a busy shared machine it is the steadier figure.
    """
    module.zero_grad(set_to_none=True)
    dist.barrier()
    a2a[0] = 0
    t0, c0 = time.perf_counter(), time.process_time()
    loss_fn(x).backward()
    return time.perf_counter() - t0, time.process_time() - c0, a2a[0]


def _speed(impls: list[str], k: int, args) -> dict:
    """Every implementation built in the same ranks and run in turn, step after step, so that
    they share whatever load the machine has: {impl: (median ms, a2a bytes)}."""
    world = dist.get_world_size()
    built = {impl: _build(impl, k, args, world) for impl in impls}
    a2a = _count_a2a()
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = {impl: [] for impl in impls}
    cpu = {impl: [] for impl in impls}
    nbytes = {}
    for _ in range(args.steps + 1):
        for impl, (module, loss_fn) in built.items():
            sec, cpu_sec, nbytes[impl] = _timed(module, loss_fn, x, a2a)
            times[impl].append(sec)
            cpu[impl].append(cpu_sec)
    med = lambda t: 1000 * statistics.median(t[1:])  # noqa: E731
    return {impl: (med(times[impl]), nbytes[impl], med(cpu[impl])) for impl in impls}


def _memory(impl: str, k: int, args) -> float:
    """Peak RSS (MiB) of a fresh rank that builds one implementation and runs two steps."""
    module, loss_fn = _build(impl, k, args, dist.get_world_size())
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        _timed(module, loss_fn, x, [0])
    return _peak_rss_mib()


def _have_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _table(world: int, k: int, impls: list[str], args) -> list[dict]:
    speed = run_distributed(_speed, world, impls, k, args, timeout=1800)
    rows = []
    for impl in impls:
        mem = run_distributed(_memory, world, impl, k, args, timeout=900) if args.memory else [float("nan")]
        ms = max(r[impl][0] for r in speed)  # the slowest rank sets the step
        rows.append(dict(impl=impl, k=k, world=world, ms=ms, tokens_per_s=args.tokens / ms * 1000,
                         cpu_ms=max(r[impl][2] for r in speed),
                         peak_rss_mib=max(mem), a2a_mib=max(r[impl][1] for r in speed) / 2**20))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the fresh-process memory rows")
    args = p.parse_args()
    impls = ["ours", "ours-dropless", "dense"] + (["deepspeed"] if _have_deepspeed() else [])
    rows = []
    print(f"hidden {args.hidden}, {args.experts} experts, {args.tokens} tokens/rank, 1 thread/rank, ep = world")
    print(f"{'world':>5} {'k':>2} {'impl':<14} {'ms/step':>9} {'tok/s/rank':>11} {'CPU ms':>8} {'peak RSS MiB':>13} "
          f"{'a2a MiB':>8} {'DS/ours':>7} {'CPU DS/ours':>11}")  # fmt: skip
    for world in args.worlds:
        for k in (1, 2):
            found = {r["impl"]: r for r in _table(world, k, impls, args)}
            rows += found.values()
            ds = found.get("deepspeed")
            for impl, r in found.items():
                ratio = f"{ds['ms'] / r['ms']:.2f}" if ds else "-"
                cpu_ratio = f"{ds['cpu_ms'] / r['cpu_ms']:.2f}" if ds else "-"
                print(f"{world:>5} {k:>2} {impl:<14} {r['ms']:>9.1f} {r['tokens_per_s']:>11.0f} "
                      f"{r['cpu_ms']:>8.1f} {r['peak_rss_mib']:>13.0f} {r['a2a_mib']:>8.2f} {ratio:>7} "
                      f"{cpu_ratio:>11}", flush=True)  # fmt: skip
            if world == 1:
                ratio = found["ours-dropless"]["ms"] / found["dense"]["ms"]
                cpu_ratio = found["ours-dropless"]["cpu_ms"] / found["dense"]["cpu_ms"]
                print(f"      dropless / dense = {ratio:.2f} (CPU time {cpu_ratio:.2f}; target <= 1.3)", flush=True)
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_layer.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))
    print(f"\nwrote {out / 'moe_layer.json'}")


if __name__ == "__main__":
    main()
