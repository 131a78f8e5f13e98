"""GPT block forward+backward: our 1D against ``torch.distributed.tensor.parallel`` (DTensor
Colwise/Rowwise) in one 4-rank gloo run, plus our 2D and 2.5D (d=1) on the same 4 ranks and 3D
(with 1D and 2.5D q=2,d=2 again for the same-P comparison) on 8 ranks.

Prints, per implementation: seconds per step and the ratio to DTensor (or to our 1D at P=8),
bytes communicated per rank per step (message bytes and ring wire bytes, from colossal.comm's
events; DTensor's collectives bypass them, so its bytes are the Megatron formula), per-rank
parameter bytes and the bytes autograd saved for backward (activations). Writes JSON to
``$COLOSSAL_BENCH_OUT`` (default ``./bench-results``).

    python bench/bench_tp_block.py                       # hidden 512, seq 256, batch 8
    python bench/bench_tp_block.py --hidden 128 --seq 64 --batch 8 --steps 3   # reduced
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

from colossal.comm import CommCounter, Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import (
    Grid2D,
    Grid3D,
    apply_1d,
    apply_2d,
    apply_2p5d,
    apply_3d,
    gpt_plan,
    grid_2p5d,
    split_input_2d,
    split_input_3d,
)
from colossal.testkit import Block, GPTConfig  # the contract GPT of the tests (a bench sibling)

BLOCK_PLAN = {k.removeprefix("blocks.*."): v for k, v in gpt_plan("1d").items() if k.startswith("blocks.*.")}


def _saved_bytes(fn):
    """Run ``fn`` counting the bytes autograd saves for backward (the activation memory)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _measure(block, x, steps):
    """Seconds per fwd+bwd step, comm bytes per step, parameter and saved-activation bytes."""
    out, saved = _saved_bytes(lambda: block(x))
    out.sum().backward()  # warm-up
    with CommCounter() as counter:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            block(x).sum().backward()
        dist.barrier()
        dt = (time.perf_counter() - t0) / steps
    return {
        "s_per_step": dt,
        "msg_bytes_per_step": counter.total_nbytes // steps,
        "wire_bytes_per_step": counter.total_wire_bytes / steps,
        "param_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
        "saved_activation_bytes": saved,
    }


def _dtensor(dense, x, steps, p):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    block = copy.deepcopy(dense)
    mesh = init_device_mesh("cpu", (p,))
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {f"attn.{n}_proj": col for n in "qkv"} | {"attn.out_proj": row, "mlp.fc_in": col, "mlp.fc_out": row}
    parallelize_module(block, mesh, plan)
    block.attn.n_head //= p
    res = _measure(block, x, steps)
    n, c = x.shape[0] * x.shape[1], x.shape[2]
    res["msg_bytes_per_step"] = 4 * n * c * 4  # Megatron: 2 all-reduces forward, 2 backward, of (N, C) fp32
    res["wire_bytes_per_step"] = res["msg_bytes_per_step"] * 2 * (p - 1) / p
    res["param_bytes"] = sum(getattr(w, "to_local", lambda w=w: w)().numel() * 4 for w in block.parameters())
    return res


def _ours(mode, dense, x, steps, mesh, depth=1):
    block = copy.deepcopy(dense)
    if mode == "1d":
        apply_1d(block, mesh.group("tp"), BLOCK_PLAN)
        return _measure(block, x, steps)
    if mode == "3d":
        apply_3d(block, mesh, BLOCK_PLAN)
        return _measure(block, split_input_3d(x, Grid3D.of(mesh.layout("3d", "tp"))), steps)
    grid = Grid2D.of(mesh.layout("2d", "tp")) if mode == "2d" else grid_2p5d(mesh, "tp", depth)
    (apply_2d(block, mesh, BLOCK_PLAN) if mode == "2d" else apply_2p5d(block, mesh, BLOCK_PLAN, depth=depth))
    return _measure(block, split_input_2d(x, grid), steps)


def _rank(args, world):
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=args.hidden, n_head=args.heads, block_size=args.seq)
    dense = Block(cfg)
    x = torch.randn(args.batch, args.seq, args.hidden)
    mesh = Mesh(axes={"tp": world})
    if world == 4:
        runs = {"dtensor_1d": lambda: _dtensor(dense, x, args.steps, world)}
        runs |= {m: (lambda m=m: _ours(m, dense, x, args.steps, mesh)) for m in ("1d", "2d")}
        runs["2.5d(d=1)"] = lambda: _ours("2.5d", dense, x, args.steps, mesh, 1)
    else:
        runs = {m: (lambda m=m: _ours(m, dense, x, args.steps, mesh)) for m in ("1d", "3d")}
        runs["2.5d(d=2)"] = lambda: _ours("2.5d", dense, x, args.steps, mesh, 2)
    return {name: run() for name, run in runs.items()}


def _report(title, results, base):
    print(f"\n{title} (ratios vs {base}; bytes per rank per step)")
    print(
        f"{'impl':12s} {'s/step':>8s} {'ratio':>6s} {'msg MiB':>8s} {'wire MiB':>9s} {'param MiB':>9s} {'act MiB':>8s}"
    )
    for name, r in results.items():
        print(
            f"{name:12s} {r['s_per_step']:8.4f} {r['s_per_step'] / results[base]['s_per_step']:6.2f} "
            f"{r['msg_bytes_per_step'] / 2**20:8.2f} {r['wire_bytes_per_step'] / 2**20:9.2f} "
            f"{r['param_bytes'] / 2**20:9.3f} {r['saved_activation_bytes'] / 2**20:8.2f}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-8", action="store_true", help="skip the 8-rank 3D phase")
    args = ap.parse_args()
    out = {"args": vars(args)}
    out["p4"] = run_distributed(_rank, 4, args, 4, timeout=1800)[0]
    _report("P=4 GPT block", out["p4"], "dtensor_1d")
    if not args.skip_8:
        out["p8"] = run_distributed(_rank, 8, args, 8, timeout=1800)[0]
        _report("P=8 GPT block", out["p8"], "1d")
    path = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "tensor_parallel_block.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path / 'tensor_parallel_block.json'}")


if __name__ == "__main__":
    main()
