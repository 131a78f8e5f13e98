"""``colossalai train``: train a GPT on the embedded corpus with any plugin, show progress,
log to TensorBoard, checkpoint, resume exactly, and finish with a summary and a sample."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossalai.booster import Booster, RunState
from colossalai.booster.registry import make_plugin
from colossalai.cli import headline
from colossalai.cli.meters import Meters, format_bytes
from colossalai.cli.progress import TrainProgress, summary_table
from colossalai.cli.train_args import SAMPLE_TEMPERATURE, SAMPLE_TOP_K, parse_bytes, seq_len_of
from colossalai.data import CorpusTokenizer, TokenWindows, load_corpus, read_text_corpus
from colossalai.models import model_family

__all__ = ["train", "criterion"]


def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits (B, T, V), targets (B, T) -> scalar (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _device_budget(args: argparse.Namespace) -> int:
    """``--device-budget``, or the default: a fraction of the model states of one process
    (``[Note: the default device budget]`` in ``colossalai.cli.headline``); for ``finetune`` the
    same as ``train`` of that model would get (the activations are the same; the frozen base holds
    no gradients or moments, so the LoRA model's states are a fraction of the budget)."""
    given = parse_bytes(args.device_budget)
    if given is not None:
        return given
    world = int(os.environ.get("WORLD_SIZE", args.nproc))  # Gemini shards the states over every rank
    if args.model == "hf":  # finetune of a Hugging Face folder: its size from the weights' headers
        from colossalai.cli.finetune import read_base

        return headline.default_device_budget(read_base(args.base).num_parameters, args.precision, world)
    family = model_family(args.model)
    preset = family.preset(args.preset)
    seq_len = seq_len_of(args, family.config(preset).block_size)
    config = family.config(preset, block_size=seq_len, vocab_size=args.vocab_size)
    return headline.default_device_budget(config.num_parameters(), args.precision, world)


def _activation_checkpointing(args: argparse.Namespace) -> bool:
    """``--[no-]activation-checkpointing``; default on with Gemini (activations count in its budget)."""
    if args.activation_checkpointing is None:
        return args.plugin == "gemini"
    return args.activation_checkpointing


def _plugin(args: argparse.Namespace):
    """The plugin named by ``--plugin`` with its own options (others must keep their defaults)."""
    budget = parse_bytes(args.device_budget)
    own = {
        "gemini": dict(
            placement=args.placement,
            device_memory_budget=_device_budget(args),
            disk_dir=args.disk_dir,
            host_memory_budget=parse_bytes(args.host_budget),
        ),
        "zero": dict(stage=args.zero_stage, offload=args.offload),
        "hybrid": dict(
            tp_size=args.tp_size
            if args.tp_size is not None
            else (2 if args.sp_size == args.pp_size == args.ep_size == 1 else 1),
            tp_mode=args.tp_mode,
            tp_depth=args.tp_depth,
            sp_size=args.sp_size,
            sp_kind=args.sp_kind,
            pp_size=args.pp_size,
            num_microbatches=args.microbatches,
            pp_schedule=args.pp_schedule,
            pp_virtual=args.pp_virtual,
            ep_size=args.ep_size,
        ),
    }
    foreign = {"--device-budget": budget is not None, "--offload": args.offload, "--zero-stage": args.zero_stage != 2}
    owner = {"--device-budget": "gemini", "--offload": "zero", "--zero-stage": "zero"}
    for flag, given in foreign.items():
        if given and owner[flag] != args.plugin:
            raise ValueError(f"{flag} applies to --plugin {owner[flag]}, got --plugin {args.plugin}")
    return make_plugin(args.plugin, **own.get(args.plugin, {}))


def _schedule(optim: torch.optim.Optimizer, warmup: int, total: int):
    """Linear warm-up then cosine decay to 10% of the peak rate."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


def _tokenizer(args: argparse.Namespace, corpus: torch.Tensor) -> CorpusTokenizer:
    """The resumed checkpoint's tokenizer, or one learned from ``corpus`` (deterministic, so every
    rank learns the same; ``[Note: why a learned subword vocabulary]`` in ``colossalai.data.tokenizer``)."""
    if not args.resume:
        return CorpusTokenizer.train(corpus, args.vocab_size)
    from colossalai.checkpoint import load_run_file, resolve_checkpoint

    saved = load_run_file(resolve_checkpoint(args.resume))["run"].get("extra", {}).get("tokenizer")
    tokenizer = CorpusTokenizer.from_json(saved) if saved else CorpusTokenizer()  # older checkpoints: bytes
    if tokenizer.vocab_size != args.vocab_size:
        raise ValueError(
            f"--vocab-size {args.vocab_size} does not match the checkpoint's tokenizer "
            f"({tokenizer.kind}, {tokenizer.vocab_size} ids): pass --vocab-size {tokenizer.vocab_size}"
        )
    return tokenizer


def _dataset(args: argparse.Namespace, seq_len: int, tokenizer: CorpusTokenizer, corpus: torch.Tensor):
    """The corpus windows; at least one global batch of them (or a ValueError naming the options)."""
    data = TokenWindows(tokenizer.encode_corpus(corpus), seq_len)
    if len(data) < args.batch_size:
        raise ValueError(
            f"--corpus-bytes {args.corpus_bytes} is {data.tokens.numel()} tokens ({tokenizer.kind}, --vocab-size "
            f"{args.vocab_size}): {len(data)} windows of {seq_len}, fewer than --batch-size {args.batch_size}"
        )
    return data


def finetuning(args: argparse.Namespace) -> bool:
    """Whether ``args`` are ``colossalai finetune``'s (a ``--base`` to adapt)."""
    return getattr(args, "base", None) is not None


def _corpus(args: argparse.Namespace) -> torch.Tensor:
    """``--corpus`` (a text file or folder) or the embedded corpus, up to ``--corpus-bytes``."""
    if args.corpus:
        return read_text_corpus(args.corpus, args.corpus_bytes)
    return load_corpus(args.corpus_bytes)


def _counts(model: torch.nn.Module) -> tuple[int, int]:
    """(frozen, trainable) parameters of ``model`` (a tied one counted once)."""
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return frozen, sum(p.numel() for p in model.parameters() if p.requires_grad)


def _build(args: argparse.Namespace, block_size: int, vocab_size: int):
    family = model_family(args.model)
    return family.build(
        family.preset(args.preset),
        seed=args.seed,
        block_size=block_size,
        vocab_size=vocab_size,
        activation_checkpointing=_activation_checkpointing(args),
    )


def _setup(args: argparse.Namespace):
    """Booster, boosted model/optimizer/loader/scheduler, the run state (resumed or fresh), the
    tokenizer, the corpus bytes per token, and (``finetune``) the base and the parameter counts."""
    from colossalai.cli import finetune

    torch.manual_seed(args.seed)
    base = finetune.apply_base(args) if finetuning(args) else None
    corpus = _corpus(args)  # read once: the tokenizer learns from it, the windows cut it
    tokenizer = base.tokenizer if base is not None else _tokenizer(args, corpus)
    if base is not None:
        seq_len = args.seq_len  # apply_base set it
    else:
        family = model_family(args.model)
        seq_len = seq_len_of(args, family.config(family.preset(args.preset)).block_size)
    booster = Booster(plugin=_plugin(args), mixed_precision=args.precision)
    dp = booster.plugin.dp_size()
    if args.batch_size % dp:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by the data-parallel size {dp}")
    counts = None
    if base is not None:  # [Note: what finetune reuses]
        if base.kind == "hf":
            model = finetune.build_hf(base, _activation_checkpointing(args))
        else:
            model = _build(args, base.block_size, tokenizer.vocab_size)
        model = booster.enable_lora(model, finetune.lora_config(args, model))
        counts = _counts(model)
    else:
        model = _build(args, seq_len, tokenizer.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = _schedule(optim, args.warmup, args.steps)
    data = _dataset(args, seq_len, tokenizer, corpus)
    loader = booster.prepare_dataloader(data, args.batch_size // dp, seed=args.seed)
    model, optim, _, loader, sched = booster.boost(model, optim, criterion, loader, sched)
    state = RunState(extra={"args": vars(args), "tokenizer": tokenizer.to_json()})  # resume and samples read it
    if args.resume:
        state = booster.load_run(args.resume, model, optim, sched, dataloader=loader)
    elif base is not None and base.kind == "checkpoint":  # the base weights into the adapted layers
        booster.load_model(model, base.path)
    elif base is not None:  # an export folder, a Hugging Face folder
        booster.load_pretrained(model, base.path)
    setup = (booster, model, optim, loader, sched, state, seq_len, tokenizer, corpus.numel() / data.tokens.numel())
    return (*setup, base, counts)


def _batches(loader, state: RunState):
    """Endless (x, y) batches; a new epoch reshuffles and resets the data position."""
    while True:
        yield from loader
        state.epoch += 1
        state.consumed_samples = 0
        loader.sampler.set_epoch(state.epoch)


def _mean_loss(loss: torch.Tensor, booster: Booster) -> float:
    value = loss.detach().float().clone()
    if dist.is_initialized() and booster.plugin.dp_size() > 1:
        dist.all_reduce(value, group=getattr(booster.plugin, "dp_group", None))
        value /= booster.plugin.dp_size()
    return value.item()


def _moe_status(model, booster: Booster) -> str:
    """``drop 1.2% balance 1.31``: the share of tokens whose every expert assignment was dropped
    (over the MoE layers and the data-parallel ranks) and the expert load balance (busiest
    expert's kept assignments over the mean, the worst layer) of the last forward; ``""`` for a
    model without MoE layers. Collective over the data-parallel group (every rank calls it)."""
    stats_of = getattr(model.unwrap(), "moe_stats", None)
    stats = stats_of() if stats_of is not None else []
    if not stats:
        return ""
    counts = torch.stack([s.expert_counts.detach().float().cpu() for s in stats])  # (layers, E)
    dropped = torch.tensor([[float(s.tokens_dropped), float(s.tokens)] for s in stats]).sum(0)
    flat = torch.cat([counts.flatten(), dropped]).to(booster.plugin.device)
    if dist.is_initialized() and booster.plugin.dp_size() > 1:
        dist.all_reduce(flat, group=getattr(booster.plugin, "dp_group", None))
    flat = flat.cpu()
    counts, (n_dropped, n_tokens) = flat[: counts.numel()].view_as(counts), flat[counts.numel() :].tolist()
    balance = (counts.max(1).values / counts.mean(1).clamp_min(1e-12)).max().item()
    return f"drop {100 * n_dropped / max(n_tokens, 1):.1f}% balance {balance:.2f}"


def profile_window(args, steps_left: int) -> tuple[int, int]:
    """(steps skipped, steps recorded) of ``--profile``: ``--profile-skip`` steps first (Gemini's
    warm-up step traces every operator and the first steps pay one-time costs), then
    ``--profile-steps``; a shorter run still records its last step(s)."""
    skip = min(args.profile_skip, max(steps_left - 1, 0))
    return skip, max(min(args.profile_steps, steps_left - skip), 1)


def _profiler(args, model, optim, tokens_per_step: int, steps_left: int):
    if not args.profile:
        return contextlib.nullcontext()
    from colossal.profiler import Profiler, Schedule

    inner = optim.unwrap()
    inner = inner if isinstance(inner, torch.optim.Optimizer) else None  # ep x ZeRO unwraps to two engines
    skip, active = profile_window(args, steps_left)
    schedule = Schedule(skip_first=skip, active=active)
    return Profiler(model.unwrap(), inner, out_dir=args.profile, tokens_per_step=tokens_per_step, schedule=schedule)


class _Logger:
    """Rank 0's TensorBoard writer (or nothing)."""

    def __init__(self, logdir: str | None, rank: int) -> None:
        self.writer = None
        if logdir and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(logdir)

    def log(self, step: int, loss: float, lr: float, meters: Meters) -> None:
        if self.writer is None:
            return
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("train/tokens_per_s", meters.tokens_per_s(), step)
        self.writer.add_scalar("train/comm_bytes", meters.communicated(), step)
        self.writer.add_scalar("train/tier_move_bytes", meters.tier_moved(), step)
        for tier, nbytes in meters.memory().items():
            self.writer.add_scalar(f"memory/{tier}", nbytes, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step(booster, model, optim, sched, batch, args) -> torch.Tensor:
    x, y = (t.to(booster.plugin.device) for t in batch)
    with torch.profiler.record_function("colossalai.train::forward_backward"):  # all micro-batches under pp
        loss = booster.execute_pipeline((x, y), model, criterion, optim)
    with torch.profiler.record_function("colossalai.train::optimizer"):
        if args.grad_clip > 0:
            booster.clip_grad_norm(optim, args.grad_clip)
        optim.step()
        sched.step()
        optim.zero_grad()
    return loss


def _loop(args, booster, model, optim, loader, sched, state, seq_len, rank):
    meters = Meters().attach()
    meters.count_ddp(model.module)
    meters.start()
    logger = _Logger(args.tensorboard, rank)
    progress = TrainProgress(args.steps, state.step, mode=args.progress, log_every=args.log_every, enabled=rank == 0)
    first = last = None
    batches = _batches(loader, state)
    try:
        tokens_per_rank = args.batch_size * seq_len // booster.plugin.dp_size()
        with _profiler(args, model, optim, tokens_per_rank, args.steps - state.step) as prof:
            while state.step < args.steps:
                loss = _mean_loss(_step(booster, model, optim, sched, next(batches), args), booster)
                state.step += 1
                state.consumed_samples += args.batch_size
                meters.tokens += args.batch_size * seq_len
                first = loss if first is None else first
                last = loss
                progress.update(state.step, loss, meters, _moe_status(model, booster))
                logger.log(state.step, loss, sched.get_last_lr()[0], meters)
                if prof is not None:
                    prof.step()
                if args.save_dir and args.save_every and state.step % args.save_every == 0:
                    booster.save_run(args.save_dir, model, optim, sched, state=state)
    finally:
        meters.stop()
        progress.close()
        logger.close()
        meters.detach()
    return meters, first, last


def _padded_forward(model, multiple: int, block_size: int):
    """``model`` on windows right-padded to a multiple of ``multiple`` tokens (sequence
    parallelism splits the sequence evenly). The model is causal, so padding on the right leaves
    the logits of the real positions unchanged; they are cut back out."""
    usable = block_size // multiple * multiple

    def forward(window: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        window = window[:, -usable:]
        t = window.shape[1]
        padded = F.pad(window, (0, -t % multiple))  # (B, ceil(T / m) * m)
        return model(padded)[:, :t]

    return forward


def _sample(
    model,
    tokenizer: CorpusTokenizer,
    n_tokens: int,
    seed: int,
    rows: int = 1,
    seq_multiple: int = 1,
    *,
    temperature: float = SAMPLE_TEMPERATURE,
    top_k: int = SAMPLE_TOP_K,
) -> str:
    """A sampled continuation of a Python prompt through the boosted model (full logits on every
    rank; the same seed everywhere keeps the ranks in step, which sharded models need).

    ``rows`` copies of the prompt are sampled and the first is returned: 2D/2.5D/3D tensor
    parallelism splits the batch over the grid, so it needs a batch divisible by it; sequence
    parallelism needs windows whose length is a multiple of ``seq_multiple``. ``temperature`` 0
    is greedy decoding, ``top_k`` 0 samples from every token.
    """
    from colossalai.models.gpt import sample_tokens

    gpt = model.unwrap()
    gpt.eval()
    prompt = tokenizer.encode("def").view(1, -1).repeat(rows, 1).to(model.device)  # (rows, T0)
    gen = torch.Generator().manual_seed(seed)
    config = gpt.config
    block = getattr(config, "block_size", None) or getattr(config, "n_positions", None)
    block = block or config.max_position_embeddings  # a Hugging Face model (finetune)
    forward = _padded_forward(model, seq_multiple, block) if seq_multiple > 1 else model

    def logits(ids: torch.Tensor) -> torch.Tensor:
        result = forward(ids)
        return getattr(result, "logits", result)  # a transformers ModelOutput

    with torch.no_grad():
        top_k = top_k or None  # 0: every token
        kw = dict(temperature=temperature, top_k=top_k, generator=gen)
        out = sample_tokens(logits, prompt, n_tokens, block, **kw)
    gpt.train()
    return tokenizer.decode(out[0].cpu())


def _loss_row(first: float | None, last: float | None, tokenizer: CorpusTokenizer, bytes_per_token: float) -> str:
    """'5.5 -> 3.6 (1.19 per byte)': per token, and per byte of text for a BPE (comparable across vocabularies)."""
    if first is None:
        return "n/a"
    row = f"{first:.4f} -> {last:.4f}"
    return row if tokenizer.kind == "bytes" else f"{row} ({last / bytes_per_token:.2f} per byte)"


def _model_name(args: argparse.Namespace) -> str:
    """'GPT tiny', 'PaLM palm-tiny': the family and preset of ``--model`` / ``--preset`` ('Hugging
    Face gpt2' for a ``finetune`` of a Hugging Face folder)."""
    if args.model == "hf":
        return f"Hugging Face {args.preset}"
    family = model_family(args.model)
    return f"{family.label} {family.preset(args.preset)}"


def _headline(args, booster: Booster, rows: dict[str, str], meters: Meters, counts=None) -> str:
    """With Gemini: add the bytes moved per tier to ``rows`` and return the capacity line
    ("model states X = N x the device budget"; ``counts``: (frozen, trainable) parameters of a
    LoRA model); other plugins: ''."""
    engine = getattr(booster.plugin, "model", None)
    if args.plugin != "gemini" or engine is None:
        return ""
    rows.update(headline.tier_rows(engine.stats_history, meters.seconds()))
    dp = booster.plugin.dp_size()
    if counts is not None:
        states = headline.lora_state_bytes(*counts, args.precision, dp)
    else:
        states = headline.model_state_bytes(engine.module.config.num_parameters(), args.precision, dp)
    return headline.headline(states, engine.manager.device.budget, engine.manager.device.kind)


def _num_parameters(model, counts: tuple[int, int] | None) -> int:
    """Parameters of the model: a LoRA model's frozen and trainable ones, else its config's count."""
    return sum(counts) if counts is not None else model.unwrap().config.num_parameters()


def _finetune_rows(args, booster: Booster, model, base, counts: tuple[int, int]) -> dict[str, str]:
    """``finetune``'s summary rows: the base, the adapter (trainable share), the frozen bytes per
    tier, and where the adapter and the merged model went."""
    from colossalai.cli.finetune import frozen_bytes_per_tier

    frozen, trainable = counts
    total = frozen + trainable
    config = model.unwrap().active_peft_config
    names = config.target_modules  # peft resolves "all-linear" to the full names of the layers
    targets = names if isinstance(names, str) else ", ".join(sorted({t.rsplit(".", 1)[-1] for t in names}))
    tiers = frozen_bytes_per_tier(booster.plugin, frozen, args.precision, model.unwrap())
    return {
        "base": f"{base.path} ({base.kind})",
        "LoRA": f"r={config.r}, alpha {config.lora_alpha:g} on {targets}",
        "trainable": f"{trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%)",
        "frozen base": ", ".join(f"{t}={format_bytes(b)}" for t, b in tiers.items()) + " per process",
        "adapter": str(args.adapter_out or "-"),
        "merged": str(args.merge_out or "-"),
    }


def _write_outputs(args, booster: Booster, model, tokenizer: CorpusTokenizer, base, rank: int) -> None:
    """``--export`` (with its model card: ``finetune --base`` reads it back), and ``finetune``'s
    ``--adapter-out`` (PEFT's layout) and ``--merge-out`` (the base with the adapter merged in)."""
    from colossalai.cli.finetune import write_model_card

    block = base.block_size if base is not None else model.unwrap().config.block_size
    preset = args.preset if args.model == "hf" else model_family(args.model).preset(args.preset)
    if args.export:
        booster.export_safetensors(model, args.export)
        if rank == 0:
            write_model_card(args.export, args.model, preset, block, tokenizer)
    if base is not None and args.adapter_out:
        booster.save_lora_as_pretrained(model, args.adapter_out)
        if rank == 0:
            tokenizer.save_hf(args.adapter_out)
    if base is not None and args.merge_out:
        booster.save_merged_as_pretrained(model, args.merge_out)  # a Hugging Face base: with its config.json
        if rank == 0 and base.kind == "hf":
            from colossalai.cli.finetune import copy_tokenizer_files

            copy_tokenizer_files(base, args.merge_out)
        elif rank == 0:
            write_model_card(args.merge_out, args.model, preset, block, tokenizer)


def train(args: argparse.Namespace) -> dict:
    """Run ``colossalai train`` in this process (one rank of the job); returns the summary figures."""
    import torch.distributed as dist

    from colossal.comm import launch

    owned = not dist.is_initialized()  # a caller's own process group stays up
    info = launch()
    t0 = time.perf_counter()
    setup = _setup(args)
    booster, model, optim, loader, sched, state, seq_len, tokenizer, bytes_per_token, base, counts = setup
    start = state.step
    meters, first, last = _loop(args, booster, model, optim, loader, sched, state, seq_len, info.rank)
    if args.save_dir and (not args.save_every or state.step % args.save_every):
        booster.save_run(args.save_dir, model, optim, sched, state=state)
    _write_outputs(args, booster, model, tokenizer, base, info.rank)
    tp = getattr(booster.plugin, "tp_size", 1)  # a batch divisible by every TP grid's batch split
    sp = getattr(booster.plugin, "sp_size", 1)
    pp = getattr(booster.plugin, "pp_size", 1)  # no single forward to sample with under pp
    sample = ""
    if args.sample_tokens > 0 and pp == 1:
        sample = _sample(
            model,
            tokenizer,
            args.sample_tokens,
            args.seed,
            tp,
            sp,
            temperature=args.sample_temperature,
            top_k=args.sample_top_k,
        )
    rows = {
        "plugin": f"{args.plugin} x {info.world_size} process(es), {args.precision}",
        "model": f"{_model_name(args)}: {_num_parameters(model, counts):,} parameters",
        "tokens": f"{tokenizer.kind}, {tokenizer.vocab_size} ids, {bytes_per_token:.2f} bytes/token",
        "steps": f"{start} -> {state.step}",
        "loss": _loss_row(first, last, tokenizer, bytes_per_token),
        "tokens/s": f"{meters.tokens_per_s():,.0f}",
        "memory": ", ".join(f"{t}={format_bytes(b)}" for t, b in meters.memory().items()),
        "communicated": format_bytes(meters.communicated()),
        "moved between tiers": format_bytes(meters.tier_moved()),
        "wall time": f"{time.perf_counter() - t0:.1f} s",
        "checkpoint": str(args.save_dir or "-"),
    }
    if args.profile:
        skip, active = profile_window(args, args.steps - start)
        first_step, last_step = start + skip + 1, start + skip + active
        rows["profile"] = f"{args.profile} (steps {first_step}-{last_step}; colossal-profiler summarize)"
    if base is not None:
        rows.update(_finetune_rows(args, booster, model, base, counts))
    line = _headline(args, booster, rows, meters, counts)
    if info.rank == 0:
        from rich.console import Console

        console = Console()
        console.print(summary_table(rows, "colossalai finetune" if base is not None else "colossalai train"))
        if line:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        if sample:
            console.print("[bold]sample:[/bold]")
            console.print(sample, markup=False, highlight=False, soft_wrap=True)  # code: no line breaks added
    if owned:
        # Meet once more, then tear the group down: a rank whose interpreter exits while a peer
        # still prints (rank 0's summary) killed gloo's threads mid-connection ("terminate called
        # without an active exception", SIGABRT, a failed job after a finished run).
        dist.barrier()
        dist.destroy_process_group()
    return {**rows, "first_loss": first, "last_loss": last, "headline": line}
