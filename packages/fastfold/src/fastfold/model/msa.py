"""MSA attention: row attention with pair bias (supplementary Algorithm 7), column attention
(Algorithm 8) and global column attention (Algorithm 19)."""

from __future__ import annotations

import torch
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Attention, GlobalAttention, Linear
from fastfold.ops import LayerNorm, mask_bias

__all__ = ["MSARowAttentionWithPairBias", "MSAAttention", "MSAColumnAttention", "MSAColumnGlobalAttention"]


def _key_mask_bias(mask: torch.Tensor, inf: float) -> torch.Tensor:
    # [*, B, K] -> [*, B, 1, 1, K]: broadcast over heads and queries
    return mask_bias(mask, inf)[..., :, None, None, :]


class MSARowAttentionWithPairBias(nn.Module):
    """Attention along residues within each sequence, biased by a projection of the pair
    representation (Algorithm 7)."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9):
        super().__init__()
        self.inf = inf
        self.layer_norm_m = LayerNorm(c_m)
        self.layer_norm_z = LayerNorm(c_z)
        self.linear_z = Linear(c_z, no_heads, bias=False)
        self.mha = Attention(c_m, c_m, c_hidden, no_heads)

    def forward(self, m, z, mask, chunk_size=None, dap=None, accumulate_into=None, z_split_dim=-3) -> torch.Tensor:
        """``m`` [*, S, R, c_m] (S local under DAP), ``z`` [*, R, R, c_z] (split along ``z_split_dim``
        under DAP: -3 rows, -2 columns), ``mask`` [*, S, R] -> update of ``m`` (or
        ``accumulate_into`` with the update added)."""
        bias = self.linear_z(self.layer_norm_z(z))  # [*, R_loc, R, H] or [*, R, R_loc, H]
        pending = dap.gather_async(bias, z_split_dim) if dap is not None else None
        m_ln = self.layer_norm_m(m)  # overlaps the bias gather under DAP
        key_bias = _key_mask_bias(mask, self.inf)  # [*, S, 1, 1, R]
        bias = pending.wait() if pending is not None else bias
        bias = bias.movedim(-1, -3).contiguous().unsqueeze(-4)  # [*, 1, H, R, R], read by every chunk
        fn = lambda m_c, kb_c: self.mha(m_c, m_c, [kb_c, bias])
        return chunk_apply(fn, [m_ln, key_bias], [-3, -4], chunk_size, -3, accumulate_into)


class MSAAttention(nn.Module):
    """Gated self-attention along the second-to-last axis of [*, B, N, c] (per row b)."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int, inf: float = 1e9):
        super().__init__()
        self.inf = inf
        self.layer_norm_m = LayerNorm(c_m)
        self.mha = Attention(c_m, c_m, c_hidden, no_heads)

    def forward(self, m, mask, chunk_size=None, accumulate_into=None) -> torch.Tensor:
        """``m`` [*, B, N, c], ``mask`` [*, B, N] -> update [*, B, N, c]."""
        m_ln = self.layer_norm_m(m)
        fn = lambda m_c, kb_c: self.mha(m_c, m_c, [kb_c])
        return chunk_apply(fn, [m_ln, _key_mask_bias(mask, self.inf)], [-3, -4], chunk_size, -3, accumulate_into)


class MSAColumnAttention(nn.Module):
    """Attention along sequences within each residue column (Algorithm 8)."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int, inf: float = 1e9):
        super().__init__()
        self._msa_att = MSAAttention(c_m, c_hidden, no_heads, inf)

    def forward(self, m, mask, chunk_size=None, accumulate_into=None) -> torch.Tensor:
        """``m`` [*, S, R, c] (R local under DAP), ``mask`` [*, S, R] -> update [*, S, R, c]."""
        acc = accumulate_into.transpose(-2, -3) if accumulate_into is not None else None
        out = self._msa_att(m.transpose(-2, -3), mask.transpose(-1, -2), chunk_size, acc)  # [*, R, S, c]
        return out.transpose(-2, -3)


class MSAColumnGlobalAttention(nn.Module):
    """Global attention along sequences within each residue column (Algorithm 19, Extra-MSA stack)."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int, inf: float = 1e9, eps: float = 1e-10):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m)
        self.global_attention = GlobalAttention(c_m, c_hidden, no_heads, inf, eps)

    def forward(self, m, mask, chunk_size=None, accumulate_into=None) -> torch.Tensor:
        """``m`` [*, S, R, c] (R local under DAP), ``mask`` [*, S, R] -> update [*, S, R, c]."""
        m_t, mask_t = self.layer_norm_m(m.transpose(-2, -3)), mask.transpose(-1, -2)  # [*, R, S, c], [*, R, S]
        acc = accumulate_into.transpose(-2, -3) if accumulate_into is not None else None
        out = chunk_apply(self.global_attention, [m_t, mask_t], [-3, -2], chunk_size, -3, acc)
        return out.transpose(-2, -3)
