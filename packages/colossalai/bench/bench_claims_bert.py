"""The seed's BERT claim ("sequence parallelism: 2x the speed or 1.5x the sequence length"), on CPU.

A Hugging Face ``BertForMaskedLM`` (random weights from a ``BertConfig``) trains with AdamW on 2
ranks, one sequence per step, under plain PyTorch DDP (each rank a whole sequence: the baseline),
torch context parallelism (``torch.distributed.tensor.experimental.context_parallel``: the best
peer; ring attention over SDPA) and colossalai's ``HybridParallelPlugin(sp_size=2)`` (the built-in
BERT policy: bidirectional sequence-parallel attention). For each: the longest sequence under a
per-rank memory cap, from three measured lengths (linear through the two longest: no kernel here
keeps a (T, T) score matrix; ``fit_largest`` in ``claims_common``), and the tokens/s at the longest
measured length.
A configuration that cannot run is reported with its error.

    python packages/colossalai/bench/bench_claims_bert.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from claims_common import fit_largest, load_note, peak_bytes, rank_or_error, timed_steps, write_json

CONFIGS = ["torch-ddp", "torch-context-parallel", "colossal-sp2"]


def _model(args):
    import transformers

    config = transformers.BertConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
        intermediate_size=4 * args.hidden, vocab_size=args.vocab, max_position_embeddings=max(args.lengths),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


def _loss(model, x):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


def _setup(name: str, args):
    """``(step(tokens), tokens per step counted once)``."""
    model = _model(args)
    if name == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            _loss(model, x).backward()
            optim.step()
            optim.zero_grad()

        return step, dist.get_world_size()
    if name == "torch-context-parallel":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):  # x is split in place along T
                loss = _loss(model, x)
                loss.backward()
            for p in model.parameters():  # the sequence shards' gradients add up
                dist.all_reduce(p.grad)
            optim.step()
            optim.zero_grad()

        return step, 1
    from colossalai import Booster, HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, sp_size=dist.get_world_size()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optim, *_ = booster.boost(model, optim)

    def step(x):
        booster.backward(_loss(model, x), optim)
        optim.step()
        optim.zero_grad()

    return step, 1


def _measure(name: str, args) -> dict:
    step, dp = _setup(name, args)
    out = {"points": [], "seconds": None}
    for length in args.lengths:
        g = torch.Generator().manual_seed(dist.get_rank() if dp > 1 else 0)
        batches = [torch.randint(0, args.vocab, (1, length), generator=g) for _ in range(args.steps + 1)]
        out["seconds"] = timed_steps(step, [b.clone() for b in batches]) / args.steps
        out["points"].append((length, peak_bytes()))
    out["dp"] = dp
    return out


def _rank(name: str, args) -> dict:
    return rank_or_error(_measure, name, args)


def main() -> None:
    from colossal.comm.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--lengths", type=lambda s: [int(v) for v in s.split(",")], default=[256, 512, 768])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1, help="timed steps per length (after one warm-up step)")
    p.add_argument("--cap-mib", type=int, default=512, help="memory cap per rank (MiB)")
    args = p.parse_args()
    rows = {}
    for name in args.configs.split(","):
        res = run_distributed(_rank, 2, name, args, timeout=1500)
        errors = [r["error"] for r in res if "error" in r]
        if errors:
            rows[name] = {"error": errors[0]}
            continue
        points = [(s, max(r["points"][i][1] for r in res)) for i, s in enumerate(args.lengths)]
        # linear through the two longest: SDPA on CPU (flash kernel) and ring attention keep no
        # (T, T) score matrix, so memory grows linearly in T (the three points show the trend)
        a, b, longest = fit_largest(points[-2:], args.cap_mib * 2**20)
        coeffs = [a, b]
        seconds = max(r["seconds"] for r in res)
        tokens = args.lengths[-1] * res[0]["dp"]
        rows[name] = {"points": points, "fit": coeffs, "longest": longest, "tokens_per_s": tokens / seconds}
    _report(rows, args)


def _report(rows: dict, args) -> None:
    print(f"BERT (HF BertConfig hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), 2 ranks gloo/CPU, "
          f"one sequence per step, cap {args.cap_mib} MiB per rank; {load_note()}")  # fmt: skip
    base = rows.get("torch-ddp", {})
    print(f"{'config':<24} {'peak MiB at lengths':>22} {'longest':>8} {'vs DDP':>7} {'tokens/s':>9} {'vs DDP':>7}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<24} error: {r['error']}")
            continue
        at = " / ".join(f"{p / 2**20:.0f}" for _, p in r["points"])
        ratio_l = f"{r['longest'] / base['longest']:.2f}x" if base.get("longest") and r["longest"] else "-"
        ratio_t = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base.get("tokens_per_s") else "-"
        print(f"{name:<24} {at:>22} {r['longest'] or '-':>8} {ratio_l:>7} {r['tokens_per_s']:>9.0f} {ratio_t:>7}")
    print("lengths measured:", args.lengths)
    write_json("claims_bert", {"args": vars(args), "load": load_note(), "results": rows})


if __name__ == "__main__":
    main()
