"""Host cost per training step: operators dispatched and step time of Gemini and ZeRO against plain
PyTorch on the same GPT, one process (#28).

On a GPU a small or mid-sized model's step is bound by the host when Python dispatches more
operators than the kernels take to run; this counts them directly (``colossal.testkit.OpCounter``:
every ATen operator, views and in-place ones included) and times the step on this machine. Every
variant steps ``torch.optim.AdamW(foreach=True)``; Gemini roomy has the whole model resident,
Gemini under pressure a device budget below its model states (chunks move every step)::

    python packages/colossal-gemini/bench/bench_host_cost.py
    python packages/colossal-gemini/bench/bench_host_cost.py --n-layer 8 --n-embd 128 --steps 30
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from colossal.comm.testing import preload, run_distributed
from colossal.testkit import GPT, GPTConfig, OpCounter

preload("colossal.gemini", "colossal.zero")

VARIANTS = ("torch", "zero1", "zero2", "zero3", "gemini-roomy", "gemini-pressure")


def _build(variant: str, cfg: GPTConfig):
    """(module to call, step(loss))."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant.startswith("gemini"):
        from colossal.gemini import GeminiDDP, GeminiOptimizer

        states = 16 * sum(p.numel() for p in model.parameters())  # fp32 weights, grads, Adam's two moments
        budget = (1 << 30) if variant == "gemini-roomy" else states // 2 + (4 << 20)  # activations: 4 MiB
        gem = GeminiDDP(model, placement="auto", device_memory_budget=budget)
        opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-3, foreach=True), gem)

        def step(loss):
            opt.backward(loss)
            opt.step()
            opt.zero_grad()

        return gem, step
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if variant == "torch":

        def step(loss):
            loss.backward()
            inner.step()
            inner.zero_grad()

        return model, step
    from colossal.zero import ZeroOptimizer

    zero = ZeroOptimizer(inner, model, stage=int(variant[-1]))

    def step(loss):
        zero.backward(loss)
        zero.step()
        zero.zero_grad()

    return model, step


def measure(variant: str, cfg_kw: dict, batch: int, steps: int) -> dict:
    """Operators of one steady step and the median time of ``steps`` more."""
    cfg = GPTConfig(**cfg_kw)
    model, step = _build(variant, cfg)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))

    def one():
        logits = model(data[:, :-1])
        step(F.cross_entropy(logits.reshape(-1, cfg.vocab_size), data[:, 1:].reshape(-1)))

    for _ in range(3):  # optimizer states, Gemini's warm-up and placement
        one()
    ops = OpCounter()
    with ops:
        one()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        one()
        times.append(time.perf_counter() - t)
    return {"variant": variant, "ops": ops.total, "step_s": sorted(times)[len(times) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=15, help="timed steps (median reported)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    cfg = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
               block_size=args.seq)  # fmt: skip
    rows = [run_distributed(measure, 1, v, cfg, args.batch, args.steps, timeout=600)[0] for v in variants]
    base = next((r for r in rows if r["variant"] == "torch"), rows[0])
    print(f"GPT {cfg}, batch {args.batch}, one process, torch {torch.__version__}")
    print(f"| variant | ops/step | x {base['variant']} | step ms | x {base['variant']} |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['ops']} | {r['ops'] / base['ops']:.2f} | {1e3 * r['step_s']:.2f} | "
              f"{r['step_s'] / base['step_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
