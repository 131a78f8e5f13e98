"""The seed's ViT claim ("tensor parallelism: 14x the batch size, 5x the speed"), scaled to CPU.

A Hugging Face ``ViTForImageClassification`` (random weights from a ``ViTConfig``) trains with AdamW
under: plain PyTorch DDP (the baseline), DTensor tensor parallelism (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` over ``VIT_PLAN`` below: the best peer), and colossalai's
``HybridParallelPlugin`` in the 1D, 2D, 2.5D and 3D tensor-parallel modes with the built-in ViT
policy (no ``plan=``: 1D splits the same linears as ``VIT_PLAN``; 2D/2.5D/3D also split the patch
projection, class token, positions and LayerNorms and gather the CLS tokens before the
classifier). For each configuration: the largest global
batch under a per-rank memory cap (``[Note: largest batch under a memory cap]`` in
``claims_common``) and the throughput (images/s) at the larger measured batch, with ratios to DDP.
A mode that cannot be applied to the model is reported with the error that says why.

    python packages/colossalai/bench/bench_claims_vit.py            # ~minutes on a loaded 2-core CPU
    python packages/colossalai/bench/bench_claims_vit.py --configs torch-ddp,colossal-1d-tp4
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from claims_common import fit_largest, load_note, peak_bytes, rank_or_error, timed_steps, write_json

VIT_PLAN = {  # Megatron-style: q/k/v and fc1 split by output features, o_proj and fc2 by input features
    "vit.layers.*.attention.q_proj": "col",
    "vit.layers.*.attention.k_proj": "col",
    "vit.layers.*.attention.v_proj": "col",
    "vit.layers.*.attention.o_proj": "row",
    "vit.layers.*.mlp.fc1": "col",
    "vit.layers.*.mlp.fc2": "row",
}

# name -> (world size, kind, options); sizes are global batches
CONFIGS = {
    "torch-ddp": (4, "ddp", {}),
    "dtensor-tp4": (4, "dtensor", {}),
    "colossal-1d-tp4": (4, "hybrid", {"tp_size": 4, "tp_mode": "1d"}),
    "colossal-2d-tp4": (4, "hybrid", {"tp_size": 4, "tp_mode": "2d"}),
    "colossal-2.5d-tp8": (8, "hybrid", {"tp_size": 8, "tp_mode": "2.5d", "tp_depth": 2}),
    "colossal-3d-tp8": (8, "hybrid", {"tp_size": 8, "tp_mode": "3d"}),
}


def vit_config(args):
    import transformers

    return transformers.ViTConfig(
        image_size=args.image, patch_size=args.patch, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _dtensor_tp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda", (dist.get_world_size(),))
    styles = {"col": ColwiseParallel(), "row": RowwiseParallel()}
    for i, _ in enumerate(model.vit.layers):
        plan = {k.split("*.", 1)[1]: styles[v] for k, v in VIT_PLAN.items()}
        parallelize_module(model.vit.layers[i], mesh, plan)
    return model


def _setup(kind: str, options: dict, args):
    """``(step(batch), dp_size)`` for one configuration on this rank."""
    import transformers

    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(vit_config(args))
    loss_of = lambda m, x, y: F.cross_entropy(m(pixel_values=x).logits.float(), y)  # noqa: E731
    if kind in ("ddp", "dtensor"):
        if kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            model = _dtensor_tp(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(batch):
            loss_of(model, *batch).backward()
            optim.step()
            optim.zero_grad()

        return step, dist.get_world_size() if kind == "ddp" else 1
    from colossalai import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(**options)  # the built-in ViT policy
    booster = Booster(plugin=plugin)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optim, *_ = booster.boost(model, optim)

    def step(batch):
        booster.backward(loss_of(model, *batch), optim)
        optim.step()
        optim.zero_grad()

    return step, plugin.dp_size()


def _batches(n: int, per_rank: int, args):
    g = torch.Generator().manual_seed(1234)  # the same images on every rank (a tp group shares them)
    return [
        (torch.randn(per_rank, 3, args.image, args.image, generator=g), torch.randint(0, 10, (per_rank,), generator=g))
        for _ in range(n)
    ]


def _measure(name: str, args) -> dict:
    _, kind, options = CONFIGS[name]
    step, dp = _setup(kind, options, args)
    out = {"points": [], "seconds": None}
    for size in args.sizes:  # global batch: each dp rank gets size / dp
        batches = _batches(args.steps + 1, size // dp, args)
        seconds = timed_steps(step, batches)
        out["points"].append((size, peak_bytes()))
        out["seconds"] = seconds / args.steps
    return out


def _rank(name: str, args) -> dict:
    return rank_or_error(_measure, name, args)


def main() -> None:
    from colossal.comm.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32],
                   help="two global batch sizes, divisible by every world size")  # fmt: skip
    p.add_argument("--steps", type=int, default=2, help="timed steps per size (after one warm-up step)")
    p.add_argument("--cap-mib", type=int, default=1024, help="memory cap per rank (MiB)")
    args = p.parse_args()
    cap = args.cap_mib * 2**20
    rows = {}
    for name in args.configs.split(","):
        world = CONFIGS[name][0]
        res = run_distributed(_rank, world, name, args, timeout=1500)
        errors = [r["error"] for r in res if "error" in r]
        if errors:
            rows[name] = {"world": world, "error": errors[0]}
            continue
        points = [(s, max(r["points"][i][1] for r in res)) for i, s in enumerate(args.sizes)]
        a, b, largest = fit_largest(points, cap)
        seconds = max(r["seconds"] for r in res)
        rows[name] = {"world": world, "points": points, "fixed_mib": a / 2**20, "mib_per_image": b / 2**20,
                      "largest_batch": largest, "images_per_s": args.sizes[-1] / seconds}  # fmt: skip
    _report(rows, args)


def _report(rows: dict, args) -> None:
    base = rows.get("torch-ddp", {})
    print(f"ViT (HF ViTConfig hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"{(args.image // args.patch) ** 2 + 1} tokens), gloo/CPU, cap {args.cap_mib} MiB per rank; "
          f"{load_note()}")  # fmt: skip
    print(f"{'config':<18} {'ranks':>5} {'MiB fixed':>9} {'MiB/img':>8} {'max batch':>9} {'vs DDP':>7} "
          f"{'img/s':>7} {'vs DDP':>7}")  # fmt: skip
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<18} {r['world']:>5}  not applicable: {r['error']}")
            continue
        ddp_batch = base.get("largest_batch")
        # DDP's per-rank memory does not depend on the world size: at 8 ranks it holds 8 / 4 x the batch
        ddp_batch = ddp_batch * r["world"] // base["world"] if ddp_batch else None
        ratio_b = f"{r['largest_batch'] / ddp_batch:.2f}x" if ddp_batch and r["largest_batch"] else "-"
        ratio_t = f"{r['images_per_s'] / base['images_per_s']:.2f}x" if base.get("images_per_s") else "-"
        print(f"{name:<18} {r['world']:>5} {r['fixed_mib']:>9.0f} {r['mib_per_image']:>8.2f} "
              f"{r['largest_batch'] or '-':>9} {ratio_b:>7} {r['images_per_s']:>7.1f} {ratio_t:>7}")  # fmt: skip
    path = write_json("claims_vit", {"args": vars(args), "load": load_note(), "results": rows})
    print(f"(JSON: {path}; run {os.environ.get('COLOSSAL_BENCH_OUT', 'bench-results')})")


if __name__ == "__main__":
    main()
