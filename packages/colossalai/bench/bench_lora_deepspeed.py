"""LoRA fine-tuning against DeepSpeed ZeRO-3 + PEFT on the same model, side by side in one run.

A Hugging Face GPT-2 (random weights from a ``GPT2Config``) with a ``peft`` LoRA adapter on every
attention and MLP projection trains with AdamW (torch's, the same object in every configuration)
on 2 ranks, fp32, with activation checkpointing (``--no-checkpointing`` to turn it off), the same
batches everywhere:

- ``deepspeed-zero3``: ``deepspeed.initialize`` with ``zero_optimization.stage = 3`` (the peer; on
  this machine its CPU accelerator over gloo),
- ``colossal-zero3``: ``Booster(ZeroPlugin(stage=3))`` after ``Booster.enable_lora``,
- ``colossal-gemini``: ``Booster(GeminiPlugin(placement="auto"))`` with a device budget of 48 MiB per
  rank, under half of the frozen base's shard (the base streams between tiers every step; a budget
  holds the gathered chunks of the operators in flight and the activations, which do not shrink
  with the number of ranks),
- ``colossal-tp2``: ``Booster(HybridParallelPlugin(tp_size=2))``, 1D tensor parallelism: each rank
  holds half of every split layer of the frozen base and its adapter, and both ranks run the same
  ``2 x --batch`` rows (the tokens per step of the other configurations).

Each configuration runs in fresh processes (``run_distributed``). Memory is each rank's resident set
on a CPU machine (the allocator's bytes on CUDA): ``after setup`` is what the engine keeps once the
model is boosted (after ``gc.collect()``), ``step peak`` the peak while the timed steps run (Linux:
the peak is reset after setup through ``/proc/self/clear_refs``), both above the resident set of the
process before the model is built (torch and the imports, the same floor for every configuration).
Time is seconds per step after a warm-up step; the losses are printed so that the three runs can be
seen to train the same thing.
Ratios are against DeepSpeed; the machine is shared, so read the ratios, not the seconds.

    python packages/colossalai/bench/bench_lora_deepspeed.py            # needs deepspeed (bench venv)
    python packages/colossalai/bench/bench_lora_deepspeed.py --layers 4 --hidden 256   # quicker
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import resource
import statistics
import time

import torch
import torch.distributed as dist

CONFIGS = ["deepspeed-zero3", "colossal-zero3", "colossal-gemini", "colossal-tp2"]
TARGETS = ["c_attn", "c_proj", "c_fc"]


def _rss() -> int:
    """This process's resident set now (bytes), or the CUDA allocator's bytes."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    elif pathlib.Path("/proc/self/clear_refs").exists():
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)


def _peak() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    status = pathlib.Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(args):
    import peft
    import transformers

    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64, vocab_size=args.vocab,
        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config)
    if args.checkpointing:  # every configuration alike: the activations of one block at a time
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, fan_in_fan_out=True)
    return base, lora


def _batches(args, rank: int, device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(args.steps)]


def _both_ranks_batches(args, device) -> list[torch.Tensor]:
    """Every rank's rows together (tensor parallelism: the two ranks run the same batch)."""
    parts = [_batches(args, rank, device) for rank in range(2)]
    return [torch.cat(rows) for rows in zip(*parts, strict=True)]


def _deepspeed(args, base, lora):
    import deepspeed
    import peft

    model = peft.get_peft_model(base, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine.device


def _colossal(args, base, lora, plugin):
    from colossalai import Booster

    booster = Booster(plugin=plugin)
    model = booster.enable_lora(base, lora)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optim, *_ = booster.boost(model, optim)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        booster.backward(loss, optim)
        optim.step()
        optim.zero_grad()
        return loss

    return step, booster.plugin.device


def _run(config: str, args) -> dict:
    from colossalai import GeminiPlugin, HybridParallelPlugin, ZeroPlugin

    gemini = None
    if config.startswith("deepspeed"):
        import deepspeed  # noqa: F401 (imported before the baseline: its own import is not the engine's memory)
    gc.collect()
    baseline = _rss()  # torch, transformers, the engines' imports: the same floor for every configuration
    base, lora = _model(args)
    frozen = sum(p.numel() * p.element_size() for p in base.parameters())
    if config == "deepspeed-zero3":
        step, device = _deepspeed(args, base, lora)
    elif config == "colossal-zero3":
        step, device = _colossal(args, base, lora, ZeroPlugin(stage=3))
    elif config == "colossal-tp2":
        step, device = _colossal(args, base, lora, HybridParallelPlugin(tp_size=2))
    else:
        gemini = GeminiPlugin(placement="auto", device_memory_budget=args.gemini_budget, chunk_size=args.chunk_size)
        step, device = _colossal(args, base, lora, gemini)
    del base
    gc.collect()
    after_setup = _rss() - baseline
    batches = _both_ranks_batches(args, device) if config == "colossal-tp2" else _batches(args, dist.get_rank(), device)
    losses = [step(batches[0]).item()]  # warm-up
    _reset_peak()
    times = []
    for x in batches[1:]:
        t0 = time.perf_counter()
        losses.append(step(x).item())
        times.append(time.perf_counter() - t0)
    device_peak = max(s.peak_device_bytes for s in gemini.model.stats_history) if gemini is not None else None
    return {
        "device_peak": device_peak,
        "after_setup": after_setup,
        "step_peak": _peak() - baseline,
        "s_per_step": statistics.median(times),
        "losses": losses,
        "frozen": frozen,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--gemini-budget",
        default="48MiB",
        help="Gemini device budget per rank (default 48MiB: under half the base's shard)",
    )
    parser.add_argument("--chunk-size", type=int, default=1 << 20, help="Gemini chunk elements (the embedding's)")
    parser.add_argument(
        "--checkpointing", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from claims_common import load_note, rank_or_error, write_json

    from colossal.comm.testing import run_distributed

    results = {}
    for config in args.configs.split(","):
        ranks = run_distributed(rank_or_error, 2, _run, config, args, timeout=900)
        results[config] = ranks
    mib = 2**20
    shape = f"GPT-2 {args.layers} x {args.hidden}, vocab {args.vocab}, LoRA r={args.rank} on {TARGETS}, 2 ranks"
    print(
        f"{shape}, {args.batch} x {args.seq} tokens per rank, fp32, checkpointing {args.checkpointing}; {load_note()}"
    )
    ref = results.get("deepspeed-zero3", [{}])[0]
    for config, ranks in results.items():
        if "error" in ranks[0]:
            print(f"{config:16s} error: {ranks[0]['error']}")
            continue
        setup = max(r["after_setup"] for r in ranks)
        peak = max(r["step_peak"] for r in ranks)
        sec = max(r["s_per_step"] for r in ranks)
        row = f"{config:16s} after setup {setup / mib:7.1f} MiB  step peak {peak / mib:7.1f} MiB  {sec:.3f} s/step"
        if "error" not in ref and ref:
            rsec = max(r["s_per_step"] for r in results["deepspeed-zero3"])
            rpeak = max(r["step_peak"] for r in results["deepspeed-zero3"])
            row += f"  peak x{peak / rpeak:.2f}  speed x{rsec / sec:.2f} vs deepspeed"
        if ranks[0]["device_peak"] is not None:
            row += f"  device peak {max(r['device_peak'] for r in ranks) / mib:.1f} MiB (budget {args.gemini_budget})"
        print(row + "  losses " + " ".join(f"{v:.4f}" for v in ranks[0]["losses"]))
    write_json("bench_lora_deepspeed", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
