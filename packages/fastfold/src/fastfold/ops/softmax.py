"""Softmax over the last axis with additive biases (pair bias, mask bias) fused in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastfold.ops.backend import dispatch

__all__ = ["softmax_with_biases", "mask_bias"]


def _softmax_biases(logits: torch.Tensor, biases: list[torch.Tensor]) -> torch.Tensor:
    for b in biases:
        logits = logits + b
    return torch.softmax(logits, dim=-1)


def softmax_with_biases(logits: torch.Tensor, biases: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``softmax(logits + sum(biases), dim=-1)``; every bias broadcasts against ``logits``."""
    for i, b in enumerate(biases):
        try:
            torch.broadcast_shapes(b.shape, logits.shape)
        except RuntimeError:
            raise ValueError(
                f"biases[{i}] of shape {tuple(b.shape)} does not broadcast to logits {tuple(logits.shape)}"
            ) from None
    return dispatch(_softmax_biases)(logits, list(biases))


def mask_bias(mask: torch.Tensor, inf: float) -> torch.Tensor:
    """``inf * (mask - 1)``: 0 where ``mask`` is 1, ``-inf`` (large finite) where it is 0."""
    return inf * (mask - 1)
