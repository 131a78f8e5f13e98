"""Host bytes of Gemini with a frozen base (LoRA) against full fine-tuning of the same GPT (not CI).

A 3.3 M-parameter GPT (4 layers, width 256), bf16, static placement with every chunk on the host, two
AdamW steps; LoRA adapters of rank 4 on the q/v projections, the rest frozen. Prints the host tier's
accounted bytes per parameter for both and their ratio ([Note: frozen chunks] in
``colossal.gemini.chunk``: a frozen chunk is its working shard only)::

    python packages/colossal-gemini/bench/bench_frozen.py
"""

from __future__ import annotations

import torch

from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.testkit import GPT, GPTConfig, add_adapters, lm_loss, random_batches


def host_bytes(lora: bool) -> tuple[int, int]:
    """(parameters, host bytes after two steps)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(init="torch", n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=64))
    if lora:
        add_adapters(model, r=4)
    n = sum(p.numel() for p in model.parameters())
    gem = GeminiDDP(model, placement="static", offload_param_frac=1.0, device_memory_budget=64 << 20,
                    mixed_precision=torch.bfloat16)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.AdamW([p for p in gem.parameters() if p.requires_grad], lr=1e-3), gem)
    for x, y in random_batches(2, batch=2, seq=32, vocab=512):
        opt.backward(lm_loss(gem(x), y))
        opt.step()
    return n, gem.manager.host.used_bytes


def main() -> None:
    rows = {name: host_bytes(lora) for name, lora in (("full fine-tuning", False), ("LoRA, frozen base", True))}
    for name, (n, b) in rows.items():
        print(f"{name:18s} params {n:>9,d}  host {b / 1e6:6.1f} MB  {b / n:5.2f} B/param")
    full, lora = (b for _, b in rows.values())
    print(f"host bytes full / LoRA: {full / lora:.2f}x")


if __name__ == "__main__":
    main()
