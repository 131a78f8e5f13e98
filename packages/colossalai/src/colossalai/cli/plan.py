"""``colossalai plan``: which layouts fit this model on this hardware, and how fast each runs.

The model is a preset of :mod:`colossalai.models` (``--model gpt --preset 1.3b``) or a Hugging
Face ``config.json`` (``--model path/to/config.json``, built with ``transformers``' ``from_config``
on the meta device); the hardware a preset card or node (``--hardware rtx3090``, ``dgx-h100``...)
or ``this`` (measured; ``--calibrate`` first for real speed figures). Nothing is allocated: the
model is traced on the meta device by :func:`colossal.planner.trace_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from colossalai.cli.validate import UsageError
from colossalai.models import MODELS

__all__ = ["add_plan_arguments", "plan_command"]


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Register every ``plan`` option on ``p``."""
    p.add_argument("--model", default="gpt", help=f"a model family ({', '.join(MODELS)}) or a Hugging Face config.json")
    presets = [name for family in MODELS.values() for name in family.presets]
    p.add_argument("--preset", default=None, choices=presets, help="model size of a family (default: its mini preset)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch size in sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's block size)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"], help="working precision")
    p.add_argument(
        "--activation-checkpointing", action=argparse.BooleanOptionalAction, default=False, help="recompute activations"
    )
    p.add_argument("--hardware", default="this", help="a preset (rtx2060, rtx3090, a100-40gb, a100-80gb, h100, h200, "
                   "dgx-a100, dgx-h100, ...) or 'this' (default: this machine)")  # fmt: skip
    p.add_argument("--devices", type=int, default=None, help="devices per node (default: the preset's)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1)")
    p.add_argument("--device-memory", default=None, help="override the device memory, e.g. 24GiB")
    p.add_argument("--host-memory", default=None, help="override the host RAM per node, e.g. 64GiB")
    p.add_argument("--disk-dir", default=None, help="where a disk tier would live (its free space is read)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine first (about a minute) and save it")
    p.add_argument("--coefficients", default=None, help="calibration file (default: the one --calibrate saved)")
    p.add_argument("--top", type=int, default=None, help="show only the N best layouts")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _model_factory(args: argparse.Namespace):
    """(factory, model flags for the train command, label) for ``--model``/``--preset``."""
    if args.model in MODELS:
        family = MODELS[args.model]
        preset = family.preset(args.preset)
        config = family.config(preset)
        block = getattr(config, "block_size", None) or getattr(config, "max_seq_len", None)
        if args.seq_len is None:
            args.seq_len = block or 128
        elif block is not None and args.seq_len > block:
            raise UsageError(f"--seq-len {args.seq_len} is longer than the {preset} preset's block size {block}")
        flags = f"--model {args.model} --preset {preset}"
        if getattr(config, "vocab_size", None):  # the vocabulary planned with (train's default differs)
            flags += f" --vocab-size {config.vocab_size}"
        return (lambda: _build_meta(family, preset)), flags, f"{family.label} {preset}"
    path = pathlib.Path(args.model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"--model must be one of {sorted(MODELS)} or a Hugging Face config.json, got {args.model!r}")
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise UsageError("--model config.json needs transformers: pip install 'colossal-stack[hf]'") from exc
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))  # this file, not its folder's config.json
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    positions = getattr(config, "max_position_embeddings", None)
    if args.seq_len is None:
        args.seq_len = min(positions or 2048, 2048)
    elif positions is not None and args.seq_len > positions:
        raise UsageError(f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings {positions}")
    factory = lambda: transformers.AutoModelForCausalLM.from_config(config)  # noqa: E731
    return factory, None, f"{config.model_type} ({path})"


def _build_meta(family, preset: str):
    import torch

    with torch.device("meta"):
        return family.build(preset)


def _hardware(args: argparse.Namespace):
    from colossal.comm import as_bytes
    from colossal.planner import hardware_preset, load_coefficients, this_machine

    coefficients = None
    if args.disk_dir is not None and not os.path.isdir(args.disk_dir):
        raise UsageError(f"--disk-dir {args.disk_dir!r} is not a directory")
    if args.calibrate:
        from colossal.planner import calibrate, save_coefficients

        print("calibrating this machine (about a minute) ...", file=sys.stderr)
        import dataclasses

        from colossalai.cli.plan_calibrate import engine_overheads

        coefficients = calibrate(disk_dir=args.disk_dir)
        measured = coefficients.apply(this_machine(args.disk_dir))
        print("calibrating the engines' host cost ...", file=sys.stderr)
        overheads = engine_overheads(measured, coefficients.op_overhead_seconds)
        coefficients = dataclasses.replace(coefficients, engine_overhead=overheads)
        saved = (
            save_coefficients(coefficients)
            if args.coefficients is None
            else save_coefficients(coefficients, args.coefficients)
        )
        print(f"saved to {saved}", file=sys.stderr)
    elif args.hardware == "this":
        try:
            coefficients = load_coefficients() if args.coefficients is None else load_coefficients(args.coefficients)
        except FileNotFoundError:
            if args.coefficients is not None:
                raise
    changes = {}
    for flag, field in (("device_memory", "device_memory"), ("host_memory", "host_memory")):
        value = getattr(args, flag)
        if value is not None:
            changes[field] = as_bytes(value, f"--{flag.replace('_', '-')}")
    if args.hardware == "this":
        hw = this_machine(args.disk_dir, coefficients=coefficients)
        if args.devices or args.nodes:
            hw = hw.scaled(nodes=args.nodes or hw.nodes, devices_per_node=args.devices or hw.devices_per_node)
    else:
        kw = {k: v for k, v in (("nodes", args.nodes), ("devices", args.devices)) if v is not None}
        hw = hardware_preset(args.hardware, **kw)
    if changes:
        hw = hw.with_(**changes)
    return hw, coefficients


def plan_command(args: argparse.Namespace) -> int:
    """Run ``colossalai plan`` (exit code 2 for a bad argument, 1 when nothing fits)."""
    from colossal.planner import format_bytes, plan

    for name in ("batch_size", "seq_len", "devices", "nodes", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    factory, model_flags, label = _model_factory(args)
    hw, coefficients = _hardware(args)
    if args.batch_size % hw.world_size:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by the {hw.world_size} devices of {hw.name}")
    overhead = None
    if coefficients is not None:
        overhead = {"float32": coefficients.op_overhead_seconds, **coefficients.op_overhead_by_dtype}
    engines = coefficients.engine_overhead if coefficients is not None else None
    cands = plan(factory, batch=args.batch_size, seq=args.seq_len, hardware=hw, precision=args.precision,
                 activation_checkpointing=args.activation_checkpointing, op_overhead=overhead,
                 engine_overhead=engines)  # fmt: skip
    if args.top:
        cands = cands[: args.top]
    if args.json:
        rows = [
            {
                "layout": c.layout.label,
                "fits": c.fits,
                "shortfalls": list(c.shortfalls),
                "tiers": c.tiers.to_dict(),
                "breakdown": c.memory.breakdown,
                "comm_bytes": c.comm,
                "step_seconds": c.time.total,
                "tokens_per_second": c.tokens_per_second,
                "mfu": c.mfu,
                "command": c.command(model_flags, args.batch_size, args.seq_len) if model_flags else None,
                "checkpointing": c.checkpointing,
                "booster_code": c.booster_code(),
            }  # fmt: skip
            for c in cands
        ]
        print(json.dumps({"model": label, "hardware": hw.to_dict(), "batch": args.batch_size, "seq": args.seq_len,
                          "layouts": rows}, indent=2, default=str))  # fmt: skip
        return 0 if any(c.fits for c in cands) else 1
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    trace_params = sum(p.numel() for p in _count_params(factory))
    size = f"{trace_params / 1e9:.2f} B" if trace_params >= 1e9 else f"{trace_params / 1e6:.1f} M"
    table = Table(title=f"{label} ({size} parameters), batch {args.batch_size} x {args.seq_len} tokens, on {hw.name}")
    for col in ("layout", "device", "host", "disk", "step", "tokens/s", "MFU", "fits"):
        table.add_column(col, justify="left" if col in ("layout", "fits") else "right")
    for c in cands:
        if not c.runnable:
            table.add_row(c.layout.label, *["-"] * 6, "no")
            continue
        fits = "yes" if c.fits else "no"
        table.add_row(c.layout.label, format_bytes(c.tiers.device), format_bytes(c.tiers.host_total),
                      format_bytes(c.tiers.disk), f"{c.time.total * 1e3:.0f} ms", f"{c.tokens_per_second:,.0f}",
                      f"{100 * c.mfu:.0f}%", fits)  # fmt: skip
    console.print(table)
    if coefficients is None:
        console.print("speed: datasheet peaks, not calibrated (upper bounds); --hardware this --calibrate measures",
                      markup=False, highlight=False)  # fmt: skip
    for c in cands:
        if not c.fits:
            console.print(f"{c.layout.label}: " + "; ".join(c.shortfalls), markup=False, highlight=False)
    best = next((c for c in cands if c.fits), None)
    if best is None:
        console.print("nothing fits; the closest is listed first")
        return 1
    console.print(f"best: {best.layout.label}", markup=False, highlight=False)
    # plain prints: a command and code must not be re-wrapped to the terminal's width
    command = best.command(model_flags, args.batch_size, args.seq_len) if model_flags is not None else None
    if command is not None:  # `colossalai train` runs the built-in families, on one node
        print("  " + command)
    print(best.booster_code())
    return 0


def _count_params(factory):
    import torch

    with torch.device("meta"):
        return list(factory().parameters())
