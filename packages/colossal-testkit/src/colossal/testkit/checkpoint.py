"""Shared checkpoint-guarantee fixtures: a model family with missing and mis-shaped entries, the
mismatch lines they must produce, and file damage (a flipped byte, a truncation)."""

from __future__ import annotations

import pathlib

import torch
from torch import nn

__all__ = ["guarantee_model", "MISMATCH_LINES", "MISSING", "damage_file"]

MISSING = ["model/3.bias", "model/3.weight"]
"""What ``guarantee_model(extra=True)`` has and ``guarantee_model()``'s checkpoint lacks."""

MISMATCH_LINES = (
    "2 missing: model/3.bias, model/3.weight",
    "model/0.weight: checkpoint (6, 4) float32, model (4, 6) float32",
    "model/0.bias: checkpoint (6,) float32, model (4,) float32",
)
"""Lines a strict load of ``guarantee_model()``'s checkpoint into
``guarantee_model(extra=True, transposed=True)`` must print (shapes included)."""


def guarantee_model(seed: int, extra: bool = False, transposed: bool = False) -> nn.Module:
    """``Linear(4, 6) - ReLU - Linear(6, 4)``; ``transposed``: the first layer is ``Linear(6, 4)``
    (weight (4, 6) against (6, 4): the same element count, another shape); ``extra``: a fourth
    layer ``Linear(4, 2)`` (entries the checkpoint lacks)."""
    torch.manual_seed(seed)
    first = nn.Linear(6, 4) if transposed else nn.Linear(4, 6)
    layers = [first, nn.ReLU(), nn.Linear(4 if transposed else 6, 4)]
    return nn.Sequential(*layers, *([nn.Linear(4, 2)] if extra else []))


def damage_file(path: str | pathlib.Path, how: str) -> None:
    """``how="flip"``: invert the byte in the middle of ``path``; ``"truncate"``: cut it in half."""
    path = pathlib.Path(path)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    else:
        raise ValueError(f"how must be 'flip' or 'truncate', got {how!r}")
    path.write_bytes(bytes(data))
