"""Checks of every ``colossalai train`` / ``run`` argument, made before any process is spawned.

A bad argument is reported as one line and exit code 2 (argparse's convention for usage errors)
instead of N ranks each failing with a traceback minutes later. The checks need no process
group: the world size is ``--nproc`` (or ``WORLD_SIZE`` inside a launcher), and the plugin is
built, not configured, so that its own constructor checks run here too.

[Note: what is checked]
Ranges of the plain numbers; paths; plugin-only flags given to another plugin; the plugin's own
constructor checks and precisions; the parallel degrees against the world size; the global batch
against the data-parallel size; the corpus against one global batch; the GPT's shape against the
tensor/sequence-parallel split (the divisibilities ``colossal.tensor_parallel`` checks at
conversion time, restated here for the built-in GPT), against the pipeline (``n_layer`` divisible
by ``pp_size * pp_virtual`` for the uniform partition, the batch per data-parallel rank by
``--microbatches``, which ``interleaved`` needs divisible by ``pp_size``) and, for
``--model moe-gpt``, against the expert split (``--ep-size`` dividing the data-parallel size and
every MoE layer's experts; ep composes with dp, ZeRO 1/2, 1D tp and pp); the processes against
the cores (a warning) and the GPUs (an error).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib

import torch

__all__ = ["UsageError", "validate_train", "validate_finetune", "validate_run", "usable_cores"]


class UsageError(ValueError):
    """An argument that cannot work; the CLI prints it as one line and exits with code 2."""


PLUGIN_FLAGS: dict[str, tuple[str, ...]] = {
    "gemini": ("device_budget", "placement", "disk_dir", "host_budget"),
    "zero": ("zero_stage", "offload"),
    "hybrid": (
        "tp_size",
        "tp_mode",
        "tp_depth",
        "sp_size",
        "sp_kind",
        "pp_size",
        "microbatches",
        "pp_schedule",
        "pp_virtual",
        "ep_size",
    ),
}
"""Plugin -> the ``train`` options (argparse ``dest``) that only it reads."""


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_ranges(args: argparse.Namespace) -> None:
    """Counts >= 1, counts >= 0, finite positive rates."""
    at_least = {"nproc": 1, "steps": 1, "batch_size": 1, "log_every": 1, "corpus_bytes": 2}
    at_least |= {"warmup": 0, "save_every": 0, "sample_tokens": 0, "seed": 0, "profile_skip": 0, "profile_steps": 1}
    for dest, low in at_least.items():
        if getattr(args, dest) < low:
            raise UsageError(f"{_flag(dest)} must be >= {low}, got {getattr(args, dest)}")
    from colossalai.data import BYTE_VOCAB_SIZE

    if args.vocab_size < BYTE_VOCAB_SIZE:
        raise UsageError(
            f"--vocab-size must be >= {BYTE_VOCAB_SIZE} ({BYTE_VOCAB_SIZE}: plain bytes), got {args.vocab_size}"
        )
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {args.seq_len}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0, got {args.lr}")
    if not (math.isfinite(args.sample_temperature) and args.sample_temperature >= 0):
        got = args.sample_temperature
        raise UsageError(f"--sample-temperature must be a finite number >= 0 (0: greedy), got {got}")
    if args.sample_top_k < 0:
        raise UsageError(f"--sample-top-k must be >= 0 (0: all), got {args.sample_top_k}")
    if not (math.isfinite(args.grad_clip) and args.grad_clip >= 0):
        raise UsageError(f"--grad-clip must be a finite number >= 0 (0: off), got {args.grad_clip}")


def _check_paths(args: argparse.Namespace) -> None:
    """``--resume`` exists; output folders are not files."""
    if args.resume is not None and not pathlib.Path(args.resume).is_dir():
        raise UsageError(f"--resume {args.resume}: no such checkpoint folder")
    if args.corpus is not None and not pathlib.Path(args.corpus).exists():
        raise UsageError(f"--corpus {args.corpus}: no such file or folder")
    for dest in ("save_dir", "export", "profile", "tensorboard", "adapter_out", "merge_out"):
        path = getattr(args, dest, None)
        if path is not None and pathlib.Path(path).exists() and not pathlib.Path(path).is_dir():
            raise UsageError(f"{_flag(dest)} {path}: exists and is not a folder")


def _check_plugin_flags(args: argparse.Namespace) -> None:
    """Options of one plugin given with another: refused rather than silently ignored."""
    from colossalai.cli.train_args import add_train_arguments

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    defaults = vars(parser.parse_args([]))
    for owner, dests in PLUGIN_FLAGS.items():
        given = [_flag(d) for d in dests if getattr(args, d) != defaults.get(d)]
        if given and owner != args.plugin:
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{', '.join(given)} {verb} to --plugin {owner}, got --plugin {args.plugin}")


def _build_plugin(args: argparse.Namespace):
    """The plugin (its constructor validates its options) and its check of ``--precision``."""
    from colossalai.booster.precision import parse_precision
    from colossalai.cli.train import _plugin

    try:
        plugin = _plugin(args)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise UsageError(str(exc)) from None
    precision = parse_precision(args.precision)
    if precision not in plugin.supported_precisions:
        supported = ", ".join(p.value for p in plugin.supported_precisions)
        raise UsageError(f"--plugin {args.plugin} supports --precision {supported}; got {args.precision}")
    return plugin


MODEL_PARALLEL = ("pp_size", "tp_size", "sp_size")
"""Plugin attributes holding model-parallel degrees (processes per model replica = their product)."""


def _model_parallel(plugin) -> dict[str, int]:
    """The plugin's model-parallel degrees: ``{"tp": 2, ...}`` (absent attributes count 1)."""
    return {name[: -len("_size")]: getattr(plugin, name, 1) for name in MODEL_PARALLEL}


def _data_parallel(args: argparse.Namespace, plugin, world: int) -> int:
    """The data-parallel size; the degrees must divide the world and dp the global batch."""
    degrees = _model_parallel(plugin)
    product = math.prod(degrees.values())
    if world % product:
        named = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1)
        raise UsageError(
            f"{named} = {product} processes per model replica must divide the world size {world} (--nproc)"
        )
    dp = world // product
    if args.batch_size % dp:
        raise UsageError(
            f"--batch-size {args.batch_size} must be divisible by the data-parallel size {dp} "
            f"(world {world} / {product} per replica)"
        )
    return dp


def _check_corpus(args: argparse.Namespace, seq_len: int) -> None:
    """At least one global batch of windows in the corpus (otherwise every epoch is empty), counting
    one token per byte; a BPE packs ~3 bytes into a token, which ``colossalai.cli.train`` checks once
    the corpus is tokenised."""
    windows = (args.corpus_bytes - 1) // seq_len
    if windows < args.batch_size:
        need = args.batch_size * seq_len + 1
        raise UsageError(
            f"--corpus-bytes {args.corpus_bytes} holds {windows} windows of {seq_len} tokens; "
            f"one batch of --batch-size {args.batch_size} needs {need} bytes"
        )


def _split_rules(config, plugin, per_rank_batch: int, seq_len: int) -> list[tuple[int, int, str, str]]:
    """``(value, divisor, what, by_what)`` the tensor/sequence-parallel split of the GPT needs."""
    tp, sp = getattr(plugin, "tp_size", 1), getattr(plugin, "sp_size", 1)
    c, h, v = config.n_embd, config.n_head, config.vocab_size
    mode, depth = getattr(plugin, "tp_mode", "1d"), getattr(plugin, "tp_depth", 1)
    power = {"1d": 1, "3d": 3}.get(mode, 2)
    q = round((tp // depth) ** (1 / power))  # 1D: tp; else the grid side (check_layout passed)
    rules = [(seq_len, sp, "--seq-len", "--sp-size")]
    if sp > 1 and getattr(plugin, "sp_kind", "ring") == "all_to_all" and h % q == 0:
        rules.append((h // q, sp, "attention heads per tensor-parallel rank", "--sp-size"))
    if tp == 1:
        return rules
    if mode == "1d":
        rules += [(config.ffn_hidden, tp, "ffn_hidden", "--tp-size")] if hasattr(config, "ffn_hidden") else []
        return rules + [(h, tp, "n_head", "--tp-size"), (v, tp, "vocab_size", "--tp-size")]
    rules += [(h, q, "n_head", f"the {mode} grid side {q}"), (c, q**power, "n_embd", f"{mode} q^{power} = {q**power}")]
    rules.append((v, q ** (power - 1), "vocab_size", f"{mode} q^{power - 1}"))
    rows = q * q if mode == "3d" else q * depth
    return rules + [(per_rank_batch, rows, "batch per data-parallel rank", f"the {mode} batch blocks {rows}")]


def _pipeline_rules(config, plugin, per_rank_batch: int) -> list[tuple[int, int, str, str]]:
    """``(value, divisor, what, by_what)`` the pipeline split needs (uniform partition)."""
    pp, virtual = getattr(plugin, "pp_size", 1), getattr(plugin, "pp_virtual", 1)
    if pp == 1:
        return []
    m = plugin.num_microbatches
    rules = [(config.n_layer, pp * virtual, "n_layer", f"--pp-size x --pp-virtual {pp} x {virtual}")]
    rules.append((per_rank_batch, m, "batch per data-parallel rank", "--microbatches"))
    if plugin.pp_schedule == "interleaved":
        rules.append((m, pp, "--microbatches", "--pp-size for --pp-schedule interleaved"))
    return rules


def _check_moe(args: argparse.Namespace, config, plugin, dp: int, name: str) -> None:
    """``--ep-size`` against the model and the data-parallel size (what ``check_ep`` checks)."""
    ep = getattr(plugin, "ep_size", 1)
    if args.model != "moe-gpt":
        if ep > 1:
            raise UsageError(f"--ep-size {ep} needs a model with experts (--model moe-gpt), got --model {args.model}")
        return
    sp = getattr(plugin, "sp_size", 1)
    if ep > 1 and sp > 1:  # what check_ep refuses: [Note: expert x sequence parallelism]
        raise UsageError(
            f"--ep-size {ep} with --sp-size {sp}: the MoE GPT's capacity and aux loss are per rank, i.e. per "
            "sequence chunk (expert x sequence parallelism is for Hugging Face Mixtral)"
        )
    if dp % ep:
        raise UsageError(f"--ep-size {ep} must divide the data-parallel size {dp}")
    if config.num_experts % ep:
        raise UsageError(f"{name}: num_experts {config.num_experts} must be divisible by --ep-size {ep}")


def _check_family(args: argparse.Namespace) -> None:
    """``--preset`` belongs to ``--model`` (checked before the plugin is built: the default Gemini
    budget is sized from the preset)."""
    from colossalai.models import model_family

    family = model_family(args.model)
    if args.preset is not None and args.preset not in family.presets:
        raise UsageError(
            f"--preset {args.preset} is not a --model {args.model} preset; choose from {list(family.presets)}"
        )


def _check_model(args: argparse.Namespace, plugin, dp: int) -> None:
    """The preset (with ``--seq-len``) is a valid model of ``--model`` that the plugin can split."""
    from colossalai.cli.train_args import seq_len_of
    from colossalai.models import model_family

    family = model_family(args.model)
    if args.model == "palm" and getattr(plugin, "tp_size", 1) > 1 and getattr(plugin, "tp_mode", "1d") != "1d":
        raise UsageError(  # colossalai.policies.PaLMPolicy: one shared key/value head, replicated over tp
            f"--model palm splits with --tp-mode 1d only (multi-query attention), got --tp-mode {plugin.tp_mode}"
        )
    preset = family.preset(args.preset)
    config = family.config(preset, vocab_size=args.vocab_size)
    seq_len = seq_len_of(args, config.block_size)
    _check_corpus(args, seq_len)
    per_rank = args.batch_size // dp
    for value, by, what, by_what in _split_rules(config, plugin, per_rank, seq_len) + _pipeline_rules(
        config, plugin, per_rank
    ):
        if value % by:
            raise UsageError(f"{family.label} {preset}: {what} {value} must be divisible by {by_what} (= {by})")
    _check_moe(args, config, plugin, dp, f"{family.label} {preset}")


def _check_processes(nproc: int) -> list[str]:
    """More processes than GPUs is an error; more than cores, a warning."""
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPU(s)")
    cores = usable_cores()
    if not torch.cuda.is_available() and nproc > cores:
        return [f"--nproc {nproc} exceeds the {cores} usable CPU core(s): ranks will share cores and run slowly"]
    return []


def validate_train(args: argparse.Namespace, world: int | None = None, *, builtin_model: bool = True) -> list[str]:
    """Check every ``train`` option; returns warnings, raises :class:`UsageError` for the first
    bad one. ``world``: processes in the job (default ``--nproc``). ``builtin_model=False`` (a
    ``finetune`` of a Hugging Face folder): the built-in families' shape rules are left out, the
    corpus is checked against ``--seq-len``."""
    _check_ranges(args)
    _check_paths(args)
    _check_plugin_flags(args)
    if builtin_model:
        _check_family(args)
    plugin = _build_plugin(args)
    world = args.nproc if world is None else world
    dp = _data_parallel(args, plugin, world)
    if builtin_model:
        _check_model(args, plugin, dp)
    else:
        _check_corpus(args, args.seq_len)
    return _check_processes(args.nproc)


def validate_finetune(args: argparse.Namespace, world: int | None = None) -> list[str]:
    """Check every ``finetune`` option: the base (its model options are set from it), the LoRA
    options, the plugin (LoRA runs under ddp, fsdp, zero, gemini and hybrid with a 1D tp mode),
    then everything ``train`` checks; returns warnings, raises :class:`UsageError` for the first bad one."""
    from colossalai.cli.finetune import apply_base

    if args.export is not None:
        raise UsageError(
            "--export writes a train run's model; finetune writes --adapter-out (the adapter, PEFT's layout) "
            "and --merge-out (the base with the adapter merged in)"
        )
    if args.plugin == "hybrid" and args.tp_mode != "1d":
        raise UsageError(
            f"finetune --plugin hybrid splits LoRA adapters with --tp-mode 1d, got --tp-mode {args.tp_mode} "
            "(2D-3D tensor parallelism is not supported with LoRA yet)"
        )
    if args.lora_rank < 1:
        raise UsageError(f"--lora-rank must be >= 1, got {args.lora_rank}")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        raise UsageError(f"--lora-alpha must be a finite number > 0, got {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora-dropout must lie in [0, 1), got {args.lora_dropout}")
    try:
        base = apply_base(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return validate_train(args, world, builtin_model=base.kind != "hf")


def validate_run(args: argparse.Namespace) -> list[str]:
    """Check the ``run`` options: processes, restarts, hostfile, port, target; returns warnings."""
    from colossalai.cli.launcher import parse_hostfile

    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port must lie in [1, 65535], got {args.master_port}")
    if not args.target:
        raise UsageError("needs a script to run (e.g. colossalai run --nproc 2 train.py)")
    if not args.module and not pathlib.Path(args.target[0]).is_file():
        raise UsageError(f"script {args.target[0]} does not exist (use -m for a module)")
    if args.hostfile is not None:
        if not pathlib.Path(args.hostfile).is_file():
            raise UsageError(f"--hostfile {args.hostfile}: no such file")
        try:
            parse_hostfile(args.hostfile)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return []
    return _check_processes(args.nproc)
