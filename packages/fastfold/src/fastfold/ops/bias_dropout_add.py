"""The gating and residual patterns of the Evoformer: ``sigmoid(g) * x`` and
``residual + dropout(x + bias)`` with a dropout mask shared along one axis (AlphaFold's row-wise and
column-wise dropout)."""

from __future__ import annotations

import torch

from fastfold.ops.backend import dispatch

__all__ = ["sigmoid_gate", "bias_dropout_add"]


def _sigmoid_gate(x: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(gate_logits) * x


def sigmoid_gate(x: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate_logits) * x`` (shapes broadcast)."""
    return dispatch(_sigmoid_gate)(x, gate_logits)


def _bias_mask_add(x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + (x + bias) * keep


def bias_dropout_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    p: float,
    training: bool,
    shared_dim: int | None = None,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + dropout(x + bias)``; the dropout mask has size 1 along ``shared_dim``
    (``-3``: row-wise, one mask shared by all rows; ``-2``: column-wise), as in AlphaFold.
    ``keep``: the scaled keep mask (``bernoulli(1 - p) / (1 - p)``, broadcastable to ``x``) to use
    instead of drawing one from the global RNG."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return residual + (x if bias is None else x + bias)
    if keep is None:
        shape = list(x.shape)
        if shared_dim is not None:
            shape[shared_dim] = 1
        keep = torch.bernoulli(x.new_full(shape, 1.0 - p)) / (1.0 - p)
    return dispatch(_bias_mask_add)(x, x.new_zeros(()) if bias is None else bias, keep, residual)
