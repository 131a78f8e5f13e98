"""Outer product mean (supplementary Algorithm 10): the MSA -> pair communication."""

from __future__ import annotations

import torch
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Linear
from fastfold.ops import LayerNorm

__all__ = ["OuterProductMean"]


class OuterProductMean(nn.Module):
    """``z_ij += Linear(mean_s a_si (x) b_sj)``, the mean taken over unmasked sequences."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3):
        super().__init__()
        self.eps = eps
        self.layer_norm = LayerNorm(c_m)
        self.linear_1 = Linear(c_m, c_hidden)
        self.linear_2 = Linear(c_m, c_hidden)
        self.linear_out = Linear(c_hidden * c_hidden, c_z, init="final")

    def _outer(self, a: torch.Tensor, b: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        outer = torch.einsum("...sic,...sje->...ijce", a, b)  # [*, I, J, c, c]
        outer = self.linear_out(outer.reshape(*outer.shape[:-2], -1))  # [*, I, J, c_z]
        return outer / (self.eps + norm.unsqueeze(-1))

    def forward(self, m, mask, chunk_size=None, dap=None, accumulate_into=None) -> torch.Tensor:
        """``m`` [*, S, R, c_m] (R local under DAP), ``mask`` [*, S, R] -> pair update [*, R, R_all, c_z]."""
        m_ln = self.layer_norm(m)
        b = self.linear_2(m_ln) * mask.unsqueeze(-1)  # [*, S, J, c]
        pending = dap.gather_async(b, -2) if dap is not None else None  # overlaps the left projection
        a = self.linear_1(m_ln) * mask.unsqueeze(-1)  # [*, S, I, c]
        mask_j = mask if dap is None else dap.gather_nograd(mask, -1)
        b = b if pending is None else pending.wait()
        norm = torch.einsum("...si,...sj->...ij", mask, mask_j)  # [*, I, J]
        fn = lambda a_c, n_c: self._outer(a_c, b, n_c)
        return chunk_apply(fn, [a, norm], [-2, -2], chunk_size, -3, accumulate_into)
