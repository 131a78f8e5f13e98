"""Named GPT sizes, from a test-sized toy to multi-billion parameters, and a builder.

Parameter counts below are for the byte-level vocabulary (256) used by the embedded corpus.
"""

from __future__ import annotations

import dataclasses

import torch

from colossalai.models.gpt import GPT, GPTConfig

__all__ = ["PRESETS", "gpt_config", "build_gpt", "LAZY_THRESHOLD"]

PRESETS: dict[str, dict] = {
    "tiny": dict(n_embd=32, n_layer=2, n_head=4, block_size=64),  # ~35 K parameters; tests and CPU demos
    "mini": dict(n_embd=128, n_layer=4, n_head=4, block_size=128),  # ~0.8 M
    "small": dict(n_embd=512, n_layer=12, n_head=8, block_size=256),  # ~38 M
    "medium": dict(n_embd=1024, n_layer=24, n_head=16, block_size=1024),  # ~0.3 B
    "1.3b": dict(n_embd=2048, n_layer=24, n_head=16, block_size=2048),  # ~1.2 B
    "2.7b": dict(n_embd=2560, n_layer=32, n_head=32, block_size=2048),  # ~2.5 B
    "6.7b": dict(n_embd=4096, n_layer=32, n_head=32, block_size=2048),  # ~6.4 B
}
"""Preset name -> :class:`GPTConfig` fields."""

LAZY_THRESHOLD = 100_000_000
"""Presets with more parameters than this are built on the meta device by default."""


def gpt_config(preset: str = "tiny", **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of ``preset`` with ``overrides`` applied."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}; expected some of {sorted(fields)}")
    return GPTConfig(**{**PRESETS[preset], **overrides})


def build_gpt(
    preset: str | GPTConfig = "tiny",
    *,
    device: torch.device | str | None = None,
    lazy: bool | None = None,
    seed: int | None = None,
    **overrides,
) -> GPT:
    """Build a GPT from a preset name (or a config).

    ``lazy=True`` (default: when the model exceeds :data:`LAZY_THRESHOLD` parameters and no
    ``device`` is given) returns a model on the meta device: no memory is allocated until
    :meth:`GPT.materialize` or a plugin shards it. ``seed`` makes initialisation reproducible.
    """
    config = preset if isinstance(preset, GPTConfig) else gpt_config(preset, **overrides)
    if lazy is None:
        lazy = device is None and config.num_parameters() > LAZY_THRESHOLD
    if lazy:
        with torch.device("meta"):
            return GPT(config)
    # Initialise on the CPU with a CPU generator so that a seed gives the same weights on every device.
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.device("meta"):
        model = GPT(config)
    return model.materialize("cpu", generator=gen).to(device or "cpu")
