"""Layer norm over the last axis (parameter names ``weight``/``bias`` as in OpenFold)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastfold.ops.backend import dispatch

__all__ = ["LayerNorm", "layer_norm"]


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Normalise the last axis of ``x`` then scale by ``weight`` and shift by ``bias``."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} channels in its last axis, the layer norm expects {weight.shape[-1]}")
    return dispatch(_layer_norm)(x, weight, bias, eps)


class LayerNorm(nn.Module):
    """Layer norm with learnable scale (``weight``) and offset (``bias``)."""

    def __init__(self, c: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised ``x`` (same shape)."""
        return layer_norm(x, self.weight, self.bias, self.eps)
