"""Mixed-precision modes the Booster understands."""

from __future__ import annotations

import enum

import torch

__all__ = ["Precision", "parse_precision"]


class Precision(enum.StrEnum):
    """Compute precision of the forward/backward pass (master weights stay fp32)."""

    FP32 = "fp32"
    """Everything in float32."""
    FP16 = "fp16"
    """float16 autocast with dynamic loss scaling (``colossal.optim.DynamicLossScaler``)."""
    BF16 = "bf16"
    """bfloat16 autocast; no loss scaling needed."""

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (float32 for FP32)."""
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.value]


def parse_precision(value: str | Precision | None) -> Precision:
    """``None`` -> FP32; accepts the names above (and ``"no"``/``"float32"`` aliases)."""
    if value is None or isinstance(value, Precision):
        return value or Precision.FP32
    aliases = {"no": "fp32", "float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
    name = aliases.get(str(value).lower(), str(value).lower())
    try:
        return Precision(name)
    except ValueError:
        raise ValueError(f"mixed_precision must be one of {[p.value for p in Precision]}, got {value!r}") from None
