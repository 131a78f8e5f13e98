"""Softmax over the last axis with additive biases (pair bias, mask bias) fused in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastfold.ops.backend import dispatch

__all__ = ["softmax_with_biases", "mask_bias", "check_broadcast"]


def check_broadcast(shape: Sequence[int], target: Sequence[int], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``shape`` broadcasts to ``target`` (without
    growing it). Plain Python: ``torch.broadcast_shapes`` imports sympy on its first call (about
    33 MiB and 0.3 s per process)."""
    ok = len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
    if not ok:
        raise ValueError(f"{what} of shape {tuple(shape)} does not broadcast to logits {tuple(target)}")


def _softmax_biases(logits: torch.Tensor, biases: list[torch.Tensor]) -> torch.Tensor:
    for b in biases:
        logits = logits + b
    return torch.softmax(logits, dim=-1)


def softmax_with_biases(
    logits: torch.Tensor, biases: Sequence[torch.Tensor] = (), inplace: bool = False
) -> torch.Tensor:
    """``softmax(logits + sum(biases), dim=-1)``; every bias broadcasts against ``logits``.
    ``inplace``: the biases are added into ``logits`` (which the caller gives up; autograd allows it
    when ``logits`` is a fresh product such as ``q @ k^T``), so no second logits-sized buffer exists
    while the softmax output is allocated."""
    for i, b in enumerate(biases):
        check_broadcast(b.shape, logits.shape, f"biases[{i}]")
    if inplace:
        for b in biases:
            logits.add_(b)
        return torch.softmax(logits, dim=-1)
    return dispatch(_softmax_biases)(logits, list(biases))


def mask_bias(mask: torch.Tensor, inf: float) -> torch.Tensor:
    """``inf * (mask - 1)``: 0 where ``mask`` is 1, ``-inf`` (large finite) where it is 0."""
    return inf * (mask - 1)
