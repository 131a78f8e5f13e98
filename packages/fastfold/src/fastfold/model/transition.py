"""MSA and pair transitions (supplementary Algorithms 9 and 15)."""

from __future__ import annotations

import torch
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Linear
from fastfold.ops import LayerNorm

__all__ = ["Transition", "MSATransition", "PairTransition"]


class Transition(nn.Module):
    """``Linear(relu(Linear(LayerNorm(x))))`` with an ``n``-fold hidden expansion; the update is
    multiplied by the mask (as OpenFold does) when one is given."""

    def __init__(self, c: int, n: int):
        super().__init__()
        self.layer_norm = LayerNorm(c)
        self.linear_1 = Linear(c, n * c, init="relu")
        self.linear_2 = Linear(n * c, c, init="final")

    def _transition(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # inference: ReLU and mask in place (one hidden buffer, not two)
            out = self.linear_2(self.linear_1(self.layer_norm(x)).relu_())
            return out if mask is None else out.mul_(mask.unsqueeze(-1))
        out = self.linear_2(torch.relu(self.linear_1(self.layer_norm(x))))
        return out if mask is None else out * mask.unsqueeze(-1)

    def forward(self, x, mask=None, chunk_size=None, accumulate_into=None) -> torch.Tensor:
        """``x`` [*, A, B, c], ``mask`` [*, A, B] or None -> update [*, A, B, c] (chunked along A)."""
        return chunk_apply(self._transition, [x, mask], [-3, -2], chunk_size, -3, accumulate_into)


class MSATransition(Transition):
    """The MSA transition (Algorithm 9)."""


class PairTransition(Transition):
    """The pair transition (Algorithm 15)."""
