"""The seed's GPT-2 claim ("24x larger models on the same hardware"), scaled to CPU.

A Hugging Face ``GPT2LMHeadModel`` (random weights from a ``GPT2Config``) trains with AdamW on 2
ranks under plain PyTorch DDP (the baseline), FSDP2 (``fully_shard`` per block: the best peer),
colossalai ZeRO-3 and colossalai Gemini with a device budget. The question is the largest model
that trains when each rank's *device* holds at most ``--device-mib``:

* DDP, FSDP2 and ZeRO-3 keep everything on the device: their device bytes are the process's peak
  resident set above its baseline (measured before the model is built), in a fresh process;
* Gemini keeps on the device only what its placement puts there, within the budget, and the rest
  in host memory: its device bytes are Gemini's accounted device peak (``peak_device_bytes``), and
  what bounds its size is the host (``--host-mib`` per rank, resident set above the baseline).
  Its placement fills the budget it is given, so its device peak grows with the model up to the
  budget: the bench checks it stays within the budget and reports the host-bounded size.

Each configuration is measured at two depths (``--layers``); the bytes are linear in the
parameter count, so the largest count under the limit follows from the two points
(``[Note: largest batch under a memory cap]`` in ``claims_common``, here with parameters as the size).

    python packages/colossalai/bench/bench_claims_gpt2.py
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist
import torch.nn.functional as F
from claims_common import fit_largest, load_note, rank_or_error, timed_steps, write_json

CONFIGS = ["torch-ddp", "torch-fsdp2", "colossal-zero3", "colossal-gemini"]


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(layers: int, args):
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=args.hidden, n_head=args.hidden // 64, vocab_size=args.vocab, n_positions=args.seq,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _setup(name: str, model, args):
    """``(step(batch), gemini engine or None)``."""
    loss_of = lambda m, x: F.cross_entropy(m(input_ids=x[:, :-1]).logits.flatten(0, 1).float(), x[:, 1:].flatten())  # noqa: E731
    if name.startswith("torch"):
        if name == "torch-ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            loss_of(model, x).backward()
            optim.step()
            optim.zero_grad()

        return step, None
    from colossalai import Booster
    from colossalai.booster.registry import make_plugin

    if name == "colossal-zero3":
        plugin = make_plugin("zero", stage=3)
    else:
        plugin = make_plugin("gemini", device_memory_budget=args.device_mib * 2**20)
    booster = Booster(plugin=plugin)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optim, *_ = booster.boost(model, optim)

    def step(x):
        booster.backward(loss_of(model, x), optim)
        optim.step()
        optim.zero_grad()

    return step, (plugin.model if name == "colossal-gemini" else None)


def _measure(name: str, layers: int, args) -> dict:
    """One depth in fresh processes (a peak resident set is per process)."""
    import transformers  # noqa: F401 (everything imported before the baseline reading)
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import colossalai  # noqa: F401

    base = _rss()
    model = _model(layers, args)
    params = sum(p.numel() for p in model.parameters())
    step, gemini = _setup(name, model, args)
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps + 1)]
    seconds = timed_steps(step, batches) / args.steps
    host = _rss() - base
    device = max(s.peak_device_bytes for s in gemini.stats_history) if gemini is not None else host
    return {"params": params, "device": device, "host": host, "seconds": seconds}


def _rank(name: str, layers: int, args) -> dict:
    return rank_or_error(_measure, name, layers, args)


def main() -> None:
    from colossal.comm.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--layers", type=lambda s: [int(v) for v in s.split(",")], default=[2, 8])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=1, help="timed steps (after one warm-up step)")
    p.add_argument("--device-mib", type=int, default=256, help="device budget per rank (MiB)")
    p.add_argument("--host-mib", type=int, default=4096, help="host memory per rank for Gemini's offload (MiB)")
    args = p.parse_args()
    rows = {}
    for name in args.configs.split(","):
        res = [run_distributed(_rank, 2, name, layers, args, timeout=1500) for layers in args.layers]
        errors = [r["error"] for per in res for r in per if "error" in r]
        if errors:
            rows[name] = {"error": errors[0]}
            continue
        pts = [(per[0]["params"], max(r["device"] for r in per)) for per in res]
        host = [(per[0]["params"], max(r["host"] for r in per)) for per in res]
        a, b, largest = fit_largest(pts, args.device_mib * 2**20)
        ha, hb, host_largest = fit_largest(host, args.host_mib * 2**20)
        if name == "colossal-gemini":
            # Gemini's placement fills the budget it is given (its device peak grows with the model up
            # to the budget, not beyond): within the budget at both sizes, the host bounds the size
            within = all(d <= args.device_mib * 2**20 for _, d in pts)
            largest = host_largest if within else None
        rows[name] = {"device_points": pts, "host_points": host, "device_bytes_per_param": b,
                      "largest_params": largest, "seconds_per_step": max(r["seconds"] for r in res[-1])}  # fmt: skip
    _report(rows, args)


def _report(rows: dict, args) -> None:
    print(f"GPT-2 (HF GPT2Config n_embd {args.hidden}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}/rank), "
          f"2 ranks gloo/CPU, device budget {args.device_mib} MiB/rank (Gemini host {args.host_mib} MiB); "
          f"{load_note()}")  # fmt: skip
    base = rows.get("torch-ddp", {}).get("largest_params")
    print(
        f"{'config':<16} {'device B/param':>14} {'device MiB at sizes':>24} {'largest params':>15} "
        f"{'vs DDP':>7} {'s/step':>7}"
    )
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<16} error: {r['error']}")
            continue
        at = " / ".join(f"{p / 2**20:.0f}" for _, p in r["device_points"])
        largest = r["largest_params"]
        ratio = f"{largest / base:.1f}x" if base and largest else "-"
        print(f"{name:<16} {r['device_bytes_per_param']:>14.2f} {at:>24} {largest or 0:>15,} {ratio:>7} "
              f"{r['seconds_per_step']:>7.2f}")  # fmt: skip
    sizes = rows.get("torch-ddp", {}).get("device_points", [])
    print("measured at", ", ".join(f"{s:,} params" for s, _ in sizes))
    write_json("claims_gpt2", {"args": vars(args), "load": load_note(), "results": rows})


if __name__ == "__main__":
    main()
