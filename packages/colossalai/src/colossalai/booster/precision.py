"""Mixed-precision modes the Booster understands."""

from __future__ import annotations

import enum

import torch

from colossal.comm.knobs import as_dtype

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


def parse_precision(value: str | torch.dtype | Precision | None) -> Precision:
    """``None`` -> FP32; otherwise what every engine accepts (``colossal.comm.as_dtype``): a torch
    dtype (``torch.bfloat16``) or a name (``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"half"``, ``"fp32"``,
    ``"no"``)."""
    if value is None or isinstance(value, Precision):
        return value or Precision.FP32
    dtype = as_dtype(value, "mixed_precision")
    return next(p for p in Precision if p.dtype is dtype)
