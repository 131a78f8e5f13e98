"""The planner next to a published large run, on paper: torchtitan's Llama 3.1 8B on 8 H100s.

torchtitan's performance page (docs/performance.md, Table 1) reports FSDP training of Llama 3.1 8B
on one node of 8 H100 GPUs (96 GB HBM2e, 2.4 TB/s, 500 W), local batch 2, sequence 8192,
selective activation checkpointing: 5,762 tokens/s per GPU and 82.4 GiB of memory. The planner
predicts ZeRO-3 (our FSDP) on the same node from the model's config on the meta device, with full
and with no activation checkpointing (selective checkpointing lies between: the trace does not
run it), from datasheet figures (no GPU calibration).

    python packages/colossal-planner/bench/bench_published.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from colossal.planner import Layout, format_bytes, hardware_preset, plan, trace_model

PUBLISHED = {"tokens_per_second_per_gpu": 5762, "memory_gib": 82.4}


def llama_8b():
    """Llama 3.1 8B's architecture (Meta's config.json), built by transformers on the meta device."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return lambda: transformers.LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> int:
    """Print predicted next to published."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # their node: H100 with 96 GB of HBM2e at 2.4 TB/s (the SXM5 80 GB preset has 3.35 TB/s)
    hw = hardware_preset("dgx-h100", device_memory=96 * 10**9, memory_bandwidth=2.4e12)
    layout = Layout(engine="zero", zero_stage=3, dp=8, precision="bf16")
    rows = []
    for ckpt in (True, False):
        trace = trace_model(llama_8b(), batch=2, seq=8192, dtype=torch.bfloat16, device_type="cuda",
                            activation_checkpointing=ckpt)  # fmt: skip
        c = plan(trace, batch=16, seq=8192, hardware=hw, layouts=[layout])[0]
        tps = c.tokens_per_second / hw.world_size
        row = {"activation_checkpointing": "full" if ckpt else "none", "params": trace.numel,
               "device_bytes": c.tiers.device, "tokens_per_second_per_gpu": tps, "mfu": c.mfu,
               "step_seconds": c.time.total, "fits": c.fits}  # fmt: skip
        rows.append(row)
        print(f"ZeRO-3 dp8 bf16, {row['activation_checkpointing']:4s} checkpointing: device "
              f"{format_bytes(c.tiers.device):>10s} (published {PUBLISHED['memory_gib']} GiB, selective), "
              f"{tps:6.0f} tokens/s/GPU (published {PUBLISHED['tokens_per_second_per_gpu']}: "
              f"{100 * (tps / PUBLISHED['tokens_per_second_per_gpu'] - 1):+.0f}%), MFU {100 * c.mfu:.0f}%, "
              f"fits {c.fits}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"published": PUBLISHED, "predicted": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
