"""Side-by-side CPU optimizer step times: ours against torch, DeepSpeed, torch-optimizer and
pytorch-optimizer, at several thread counts, on one flat parameter and on a model-like list of
tensors of the same total size, plus a memory-bandwidth floor measured in the same run.

    DS_ACCELERATOR=cpu python packages/colossal-optim/bench/bench_optim.py [--numel 100000000]
        [--tensors 200] [--threads 1,2] [--repeats 5]

Prints the best ms/step of the timed steps, elements/s, the ratio against each peer of the same
family and the fraction of the bandwidth floor (Adam touches 28 bytes per fp32 element-step:
reads p, g, m, v; writes p, m, v). Writes JSON to $COLOSSAL_BENCH_OUT (default ./bench-results).
Missing peers are reported as such, never silently dropped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import time
from collections.abc import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from colossal.optim import CPUAdam, HybridAdam, Lamb, Lars  # noqa: E402

ADAM_BYTES = 28  # per fp32 element-step
LR = dict(adam=1e-3, lamb=1e-3, lars=0.1)


def layout(numel: int, tensors: int, seed: int = 0) -> list[int]:
    """``tensors`` sizes summing to ``numel``: a few large matrices and many small vectors, like a model."""
    if tensors <= 1:
        return [numel]
    gen = torch.Generator().manual_seed(seed)
    big = max(1, tensors // 3)  # weight matrices carry ~99% of the elements
    weights = torch.rand(big, generator=gen) + 0.5
    sizes = (weights / weights.sum() * numel * 0.99).long().tolist()
    small = tensors - big
    sizes += [max(1, int(numel * 0.01 / small))] * small
    sizes[0] += numel - sum(sizes)
    return sizes


def peers() -> dict[str, dict[str, Callable | None]]:
    """family -> name -> optimizer factory (None when the peer is not installed)."""
    out = {"adam": {}, "lamb": {}, "lars": {}}
    out["adam"]["torch AdamW foreach"] = lambda ps: torch.optim.AdamW(ps, lr=LR["adam"], foreach=True)
    out["adam"]["torch AdamW fused"] = lambda ps: torch.optim.AdamW(ps, lr=LR["adam"], fused=True)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out["adam"]["DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=LR["adam"], adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        out["adam"]["DeepSpeedCPUAdam"] = None
        print(f"[peer missing] DeepSpeedCPUAdam: {type(exc).__name__}: {exc}"[:200])
    try:
        import torch_optimizer

        out["lamb"]["torch-optimizer Lamb"] = lambda ps: torch_optimizer.Lamb(ps, lr=LR["lamb"], weight_decay=0.01)
    except Exception as exc:  # noqa: BLE001
        out["lamb"]["torch-optimizer Lamb"] = None
        print(f"[peer missing] torch-optimizer: {exc}"[:200])
    try:
        import pytorch_optimizer as po

        out["lamb"]["pytorch-optimizer Lamb"] = lambda ps: po.Lamb(ps, lr=LR["lamb"], weight_decay=0.01)
        out["lars"]["pytorch-optimizer LARS"] = lambda ps: po.LARS(ps, lr=LR["lars"], weight_decay=1e-4)
    except Exception as exc:  # noqa: BLE001
        out["lamb"]["pytorch-optimizer Lamb"] = out["lars"]["pytorch-optimizer LARS"] = None
        print(f"[peer missing] pytorch-optimizer: {exc}"[:200])
    return out


OURS = {
    "adam": {
        "colossal CPUAdam": lambda ps: CPUAdam(ps, lr=LR["adam"]),
        "colossal HybridAdam": lambda ps: HybridAdam(ps, lr=LR["adam"]),
        "colossal CPUAdam (grads copied)": lambda ps: CPUAdam(ps, lr=LR["adam"]),
    },
    "lamb": {
        "colossal Lamb": lambda ps: Lamb(ps, lr=LR["lamb"], weight_decay=0.01),
        # torch.compile'd two-pass LAMB; compiles during the warm-up steps
        "colossal Lamb (compiled)": lambda ps: Lamb(ps, lr=LR["lamb"], weight_decay=0.01, fused="compile"),
    },
    "lars": {"colossal Lars": lambda ps: Lars(ps, lr=LR["lars"], weight_decay=1e-4)},
}


def time_steps(factory: Callable, sizes: list[int], repeats: int, warmup: int, fresh_grads: bool) -> float:
    """Best seconds of ``opt.step()`` over ``repeats`` (the least disturbed on a shared machine);
    ``fresh_grads`` re-assigns the original grad tensors each step."""
    params = [torch.nn.Parameter(torch.randn(n) * 0.1) for n in sizes]
    grads = [torch.randn(n) * 1e-2 for n in sizes]
    for p, g in zip(params, grads):
        p.grad = g
    opt = factory(params)
    times = []
    for i in range(warmup + repeats):
        if fresh_grads:
            for p, g in zip(params, grads):
                p.grad = g
        start = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del opt, params, grads
    gc.collect()
    return min(times)


def bandwidth_floor(numel: int, repeats: int) -> float:
    """Bytes/s of ``a += b`` over ``numel`` fp32 elements (2 reads + 1 write)."""
    a, b = torch.randn(numel), torch.randn(numel)
    a.add_(b)
    times = []
    for _ in range(max(repeats, 10)):
        start = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - start)
    return 12 * numel / min(times)


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    candidates = peers()
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bw = bandwidth_floor(args.numel, args.repeats)
        print(f"\n=== {threads} thread(s): bandwidth floor {bw / 1e9:.1f} GB/s -> Adam floor "
              f"{ADAM_BYTES * args.numel / bw * 1e3:.1f} ms/step ===")  # fmt: skip
        for layout_name, sizes in (
            ("flat", [args.numel]),
            (f"{args.tensors} tensors", layout(args.numel, args.tensors)),
        ):
            for family in ("adam", "lamb", "lars"):
                entries = {**candidates[family], **OURS[family]}
                for name, factory in entries.items():
                    row = dict(threads=threads, layout=layout_name, family=family, name=name, numel=args.numel)
                    if factory is None:
                        rows.append({**row, "seconds": None})
                        continue
                    fresh = name.endswith("(grads copied)")
                    sec = time_steps(factory, sizes, args.repeats, args.warmup, fresh)
                    floor = ADAM_BYTES * args.numel / bw
                    rows.append(
                        {**row, "seconds": sec, "elements_per_s": args.numel / sec, "floor_fraction": floor / sec}
                    )
        report(rows, threads)
    return rows


def report(rows: list[dict], threads: int) -> None:
    """Print one table per layout and family with ratios against every peer measured."""
    mine = [r for r in rows if r["threads"] == threads]
    for layout_name in dict.fromkeys(r["layout"] for r in mine):
        print(f"\n-- {layout_name}, {threads} thread(s)")
        for r in (r for r in mine if r["layout"] == layout_name):
            if r["seconds"] is None:
                print(f"  {r['name']:36s} not installed")
                continue
            peers_ = [p for p in mine if p["layout"] == layout_name and p["family"] == r["family"]]
            ratios = ", ".join(
                f"{p['seconds'] / r['seconds']:.2f}x vs {p['name']}"
                for p in peers_
                if p["seconds"] and not p["name"].startswith("colossal")
            )
            ratios = ratios if r["name"].startswith("colossal") else ""
            adam = [p for p in mine if p["layout"] == layout_name and p["name"] == "colossal CPUAdam"]
            if r["name"].startswith("colossal") and r["family"] != "adam" and adam and adam[0]["seconds"]:
                ratios = f"{r['seconds'] / adam[0]['seconds']:.2f}x our CPUAdam time; " + ratios
            print(f"  {r['name']:36s} {r['seconds'] * 1e3:8.1f} ms  {r['elements_per_s'] / 1e9:6.2f} Gelem/s  "
                  f"floor {r['floor_fraction']:5.0%}  {ratios}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=100_000_000, help="total fp32 elements per layout")
    parser.add_argument("--tensors", type=int, default=200, help="tensors in the model-like layout")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (the best is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args()
    rows = run(args)
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "colossal-optim.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
