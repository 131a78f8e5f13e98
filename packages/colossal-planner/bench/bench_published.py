"""The planner next to published large runs, on paper: torchtitan's Llama 3.1 8B on 8 H100s, and
Megatron-LM's GPT runs on up to 1,536 A100s (Narayanan et al., SC21, Table 1).

torchtitan's performance page (docs/performance.md, Table 1) reports FSDP training of Llama 3.1 8B
on one node of 8 H100 GPUs (96 GB HBM2e, 2.4 TB/s, 500 W), local batch 2, sequence 8192,
selective activation checkpointing: 5,762 tokens/s per GPU and 82.4 GiB of memory. The planner
predicts ZeRO-3 (our FSDP) on the same node from the model's config on the meta device, with full
and with no activation checkpointing (selective checkpointing lies between: the trace does not
run it), from datasheet figures (no GPU calibration).

Megatron-LM (SC21, Table 1; micro-batch sizes and interleaving from NVIDIA/Megatron-LM
``examples/sc21/run_table_1.sh``): GPT models with vocabulary 51,200 and sequence 2048, fp16, full
activation recomputation, interleaved 1F1B, on DGX A100 nodes (8 x A100 80GB, NVLink, 8 HDR
InfiniBand NICs). The paper's throughput is ``F / t / GPUs`` with ``F = 96 B s l h^2 (1 + s/(6h) +
V/(16 l h))`` (recomputation included); the planner's is the same ``F`` over its predicted step
time of the same hybrid layout (``dp x tp8 x pp``), from datasheet figures (no GPU calibration).

    python packages/colossal-planner/bench/bench_published.py [--json out.json] [--skip-llama]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from colossal.planner import Layout, format_bytes, hardware_preset, plan, trace_model

PUBLISHED = {"tokens_per_second_per_gpu": 5762, "memory_gib": 82.4}

MEGATRON = (  # params (B), heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, chunks per rank, TFLOP/s/GPU
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
)
"""Rows of Megatron-LM's Table 1 (SC21) this bench predicts (the pipelined ones: without pp Megatron
accumulates micro-batches, which ``HybridParallelPlugin`` does only inside its pipeline)."""


def megatron_rows() -> list[dict]:
    """The planner's throughput for each :data:`MEGATRON` row."""
    from colossalai.models import GPT, GPTConfig

    rows = []
    for params_b, heads, h, layers, tp, pp, gpus, batch, mbs, v, published in MEGATRON:
        cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=h, vocab_size=51200, block_size=2048)
        trace = trace_model(lambda cfg=cfg: GPT(cfg), batch=mbs, seq=2048, dtype=torch.float16, device_type="cuda",
                            activation_checkpointing=True)  # fmt: skip
        dp = gpus // (tp * pp)
        lay = Layout(engine="hybrid", dp=dp, tp=tp, pp=pp, microbatches=batch // (dp * mbs), precision="fp16",
                     pp_schedule="interleaved" if v > 1 else "1f1b", pp_virtual=v)  # fmt: skip
        hw = hardware_preset("dgx-a100", nodes=gpus // 8)
        c = plan(trace, batch=batch, seq=2048, hardware=hw, layouts=[lay])[0]
        s, V = 2048, 51200
        flops = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
        tflops = flops / c.time.total / gpus / 1e12
        rows.append({"params_b": params_b, "layout": lay.label, "gpus": gpus, "published_tflops": published,
                     "predicted_tflops": tflops, "error": tflops / published - 1, "params": trace.numel,
                     "device_bytes": c.tiers.device, "fits": c.fits, "step_seconds": c.time.total,
                     "parts": {"compute": c.time.compute, "optimizer": c.time.optimizer,
                               "comm": c.time.comm}})  # fmt: skip
        print(f"Megatron {params_b:6.1f}B {lay.label:44s} published {published} TFLOP/s/GPU, predicted "
              f"{tflops:5.0f} ({100 * (tflops / published - 1):+.0f}%), device {format_bytes(c.tiers.device)}, "
              f"fits {c.fits}", flush=True)  # fmt: skip
    return rows


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
    ap.add_argument("--skip-llama", action="store_true", help="only the Megatron-LM rows")
    args = ap.parse_args(argv)
    mega = megatron_rows()
    if args.skip_llama:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"megatron": mega}, f, indent=2)
        return 0
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
            json.dump({"published": PUBLISHED, "predicted": rows, "megatron": mega}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
