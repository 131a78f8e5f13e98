"""The largest GPT each layout trains on a card, on paper (``colossal.planner``, nothing allocated).

For each card and host RAM, a binary search over the number of blocks of a GPT of a fixed width per
card (heads of 128 dimensions) finds the deepest model whose predicted per-tier peak fits
the card, the RAM and the disk: plain PyTorch (DDP on one rank, fp32, as a user runs it), ZeRO-3
with CPU offload, Gemini auto, and Gemini with a disk tier. Batch 1 x 1024 tokens, bf16,
activation checkpointing on (what a user short of memory sets), 256 GiB of free disk. Prints
parameters and the multiple of plain PyTorch's.

    python packages/colossal-planner/bench/bench_capacity.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from colossal.planner import Layout, hardware_preset, plan, trace_model
from colossalai.models import GPT, GPTConfig

LAYOUTS = {
    "plain PyTorch (fp32)": Layout(engine="ddp"),
    "ZeRO-3 + offload": Layout(engine="zero", zero_stage=3, offload=True, precision="bf16"),
    "Gemini auto": Layout(engine="gemini", placement="auto", precision="bf16"),
    "Gemini + disk": Layout(engine="gemini", placement="auto", disk=True, precision="bf16"),
}
DISK = 256 << 30
"""Free disk space given to every card (the disk tier's capacity is that of the disk: at 1 TB the
searches reach 50-70 B parameters, and Gemini's replay of those takes minutes)."""
CARDS = [  # (preset, host RAM override, GPT width)
    ("laptop-rtx2060", None, 2048),
    ("rtx3090", 64 << 30, 4096),
    ("rtx3090", 256 << 30, 4096),
    ("a100-80gb", 512 << 30, 8192),
]
SEQ = 1024


def _config(width: int, layers: int) -> GPTConfig:
    return GPTConfig(n_layer=layers, n_head=width // 128, n_embd=width, vocab_size=50304, block_size=SEQ)


def _fields(layout: Layout) -> dict:
    return {f: getattr(layout, f) for f in layout.__slots__}


def largest(hw, layout: Layout, width: int, limit: int = 100_000) -> tuple[int, int]:
    """(blocks, parameters) of the deepest GPT of ``width`` that fits (0, 0 if none).

    Most tiers' peaks are linear in the number of blocks (same blocks, activation checkpointing):
    two small plans give each tier's line, whose first crossing of its limit brackets the answer;
    a bisection with real plans finds it.
    """

    def tiers(layers: int):
        cfg = _config(width, layers)
        dtype = torch.float32 if layout.engine == "ddp" else layout.precision
        trace = trace_model(lambda: GPT(cfg), batch=1, seq=SEQ, dtype=dtype, device_type="cuda",
                            activation_checkpointing=True)  # fmt: skip
        lay = Layout(**{**_fields(layout), "host_budget": hw.host_memory // 2}) if layout.disk else layout
        cand = plan(trace, batch=1, seq=SEQ, hardware=hw, layouts=[lay])[0]
        t = cand.tiers
        return cand.fits, trace.numel, (t.device, t.host_total, t.pinned_host, t.disk)

    limits = (hw.device_memory, hw.host_memory, hw.pinnable_host_memory, hw.disk_free)
    _, _, a = tiers(2)
    _, _, b = tiers(4)
    guess = limit
    for lo_v, hi_v, cap in zip(a, b, limits, strict=True):
        slope = (hi_v - lo_v) / 2
        if slope > 0:
            guess = min(guess, int(2 + (cap - lo_v) / slope))
    # Gemini's device peak grows towards its budget rather than linearly: the line only brackets the
    # answer, which a bisection then finds with real plans
    lo, best = 0, (0, 0)
    hi = max(2, min(limit, guess + guess // 2 + 1))
    while hi < limit:
        ok, n, _ = tiers(hi)
        if not ok:
            break
        lo, best, hi = hi, (hi, n), min(limit, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, n, _ = tiers(mid)
        if ok:
            lo, best = mid, (mid, n)
        else:
            hi = mid
    return best


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name, ram, width in CARDS:
        hw = (
            hardware_preset(name, disk_free=DISK)
            if ram is None
            else hardware_preset(name, host_memory=ram, disk_free=DISK)
        )
        plain = None
        for label, layout in LAYOUTS.items():
            layers, n = largest(hw, layout, width)
            plain = n if plain is None else plain
            ratio = n / plain if plain else float("inf")
            rows.append({"card": hw.name, "host_memory": hw.host_memory, "width": width, "layout": label,
                         "blocks": layers, "parameters": n, "x_plain": ratio})  # fmt: skip
            print(f"{hw.name:44s} {hw.host_memory / 2**30:5.0f} GiB RAM  {label:22s} {layers:5d} blocks "
                  f"{n / 1e9:7.2f} B params  {ratio:6.1f}x plain", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
