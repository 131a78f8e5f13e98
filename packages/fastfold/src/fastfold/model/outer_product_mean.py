"""Outer product mean (supplementary Algorithm 10): the MSA -> pair communication."""

from __future__ import annotations

import torch
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Linear
from fastfold.ops import LayerNorm

__all__ = ["OuterProductMean"]


# [Note: outer product mean contraction order]
# o_ijz = sum_{c,e} W_zce sum_s a_sic b_sje. OpenFold (and the paper) form the outer product
# [I, J, c, e] first: I*J*c*e*(S + c_z) multiply-adds and an [I, J, c*e] intermediate (c*e = 1024
# channels: 8x the pair representation). Contracting W into b first, bw_sjzc = sum_e W_zce b_sje,
# then o_ij = sum_{s,c} a_sic bw_sjzc (one GEMM of [I, S*c] x [S*c, J*c_z]) costs
# S*J*e*c_z*c + I*J*S*c*c_z: fewer when S < c (2x fewer at S=16, c=32) and its intermediate is
# [S, J, c_z, c] instead. Under DAP the rows i are local (I = R/n) and b is gathered whole
# (J = R): contracting W into b first would cost every rank the whole S*J*e*c_z*c. Contracting W
# into the local a instead, aw_size = sum_c a_sic W_zce, then o_ij = sum_{s,e} aw_size b_sje (one GEMM of [I*c_z, S*e] x
# [S*e, J]), costs S*I*c*c_z*e + I*J*S*e*c_z: both terms shrink with the local I. Of the three
# orders the cheapest is chosen from the shapes (ties: outer first, then b first); all are the
# same sum, so they differ by float rounding only. b first is chunked along columns j, the other
# two along rows i. The contracted intermediate is produced by a GEMM batched over W's other
# channel (c for bw, e for aw), so it comes out as [c, S, J, c_z] (or [e, S, I, c_z]) and is the
# second GEMM's operand without a copy; only the small a (or b) is regrouped to match. Regrouping
# the [S, J, c_z, c] intermediate instead cost a permuting copy that alone took 29 ms per call at
# n_res 64 (16 MiB, innermost axis changed).


def _shared_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` [*, N, k] times each of ``w`` [B, k, n] -> [*, B, N, n], as ``bmm`` of ``x`` expanded
    over B: the same kernel with and without autograd (``torch.matmul``'s broadcasting picks its
    path by ``requires_grad``, which [Note: checkpointing with the inference forward] cannot have)."""
    lead, (n, k) = x.shape[:-2], x.shape[-2:]
    outs = [torch.bmm(x_i.expand(w.shape[0], n, k), w) for x_i in x.reshape(-1, n, k)]
    out = outs[0] if len(outs) == 1 else torch.stack(outs)
    return out.view(*lead, *out.shape[-3:])


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

    def _by_columns(self, a2: torch.Tensor, b_c: torch.Tensor, norm_c: torch.Tensor) -> torch.Tensor:
        """The same update with ``linear_out`` contracted into ``b`` first (see
        [Note: outer product mean contraction order]); ``a2`` [*, I, c*S], ``b_c`` [*, S, J_c, e]."""
        c_z, (n_seq, n_j, e) = self.linear_out.out_features, b_c.shape[-3:]
        c = a2.shape[-1] // n_seq
        w = self.linear_out.weight.view(c_z, c, e).permute(1, 2, 0)  # [c, e, c_z]
        bw = _shared_bmm(b_c.reshape(*b_c.shape[:-3], n_seq * n_j, e), w)  # [*, c, S*J_c, c_z]
        bw = bw.reshape(*bw.shape[:-3], c * n_seq, n_j * c_z)  # [*, c*S, J_c*c_z], no copy
        out = (a2 @ bw).view(*a2.shape[:-1], n_j, c_z)  # [*, I, J_c, c_z]
        out = out + self.linear_out.bias
        return out / (self.eps + norm_c.unsqueeze(-1))

    def _by_rows(self, a_c: torch.Tensor, b2: torch.Tensor, norm_c: torch.Tensor) -> torch.Tensor:
        """The same update with ``linear_out`` contracted into ``a`` first (see [Note: outer product
        mean contraction order]); ``a_c`` [*, S, I_c, c], ``b2`` [*, J, e*S] -> [*, I_c, J, c_z]."""
        c_z, (n_seq, n_i, c) = self.linear_out.out_features, a_c.shape[-3:]
        n_j, e = b2.shape[-2], b2.shape[-1] // n_seq
        w = self.linear_out.weight.view(c_z, c, e).permute(2, 1, 0)  # [e, c, c_z]
        aw = _shared_bmm(a_c.reshape(*a_c.shape[:-3], n_seq * n_i, c), w)  # [*, e, S*I_c, c_z]
        aw = aw.reshape(*aw.shape[:-3], e * n_seq, n_i * c_z)  # [*, e*S, I_c*c_z], no copy
        out = (b2 @ aw).view(*b2.shape[:-2], n_j, n_i, c_z).transpose(-2, -3).contiguous()  # [*, I_c, J, c_z]
        out = out + self.linear_out.bias
        return out / (self.eps + norm_c.unsqueeze(-1))

    def _order(self, n_seq: int, n_i: int, n_j: int) -> str:
        """``"outer"``, ``"b"`` or ``"a"``: the contraction order with the fewest multiply-adds."""
        c, e, c_z = self.linear_1.out_features, self.linear_2.out_features, self.linear_out.out_features
        costs = {
            "outer": n_i * n_j * c * e * (n_seq + c_z),
            "b": n_seq * n_j * e * c_z * c + n_i * n_j * n_seq * c * c_z,
            "a": n_seq * n_i * c * c_z * e + n_i * n_j * n_seq * e * c_z,
        }
        return min(costs, key=lambda k: (costs[k], list(costs).index(k)))

    def forward(self, m, mask, chunk_size=None, dap=None, accumulate_into=None, mask_all=None) -> torch.Tensor:
        """``m`` [*, S, R, c_m] (R local under DAP), ``mask`` [*, S, R] -> pair update [*, R, R_all, c_z].
        ``mask_all``: under DAP, the whole mask [*, S, R_all] when the caller has it (else gathered)."""
        m_ln = self.layer_norm(m)
        b = self.linear_2(m_ln) * mask.unsqueeze(-1)  # [*, S, J, c]
        pending = dap.gather_async(b, -2) if dap is not None else None  # overlaps the left projection
        a = self.linear_1(m_ln) * mask.unsqueeze(-1)  # [*, S, I, c]
        mask_j = mask if dap is None else (mask_all if mask_all is not None else dap.gather_nograd(mask, -1))
        b = b if pending is None else pending.wait()
        norm = torch.einsum("...si,...sj->...ij", mask, mask_j)  # [*, I, J]
        order = self._order(a.shape[-3], a.shape[-2], b.shape[-2])
        if order == "b":
            a2 = a.permute(*range(a.dim() - 3), -2, -1, -3).reshape(*a.shape[:-3], a.shape[-2], -1)  # [*, I, c*S]
            fn = lambda b_c, n_c: self._by_columns(a2, b_c, n_c)
            return chunk_apply(fn, [b, norm], [-2, -1], chunk_size, -2, accumulate_into)  # chunks of columns j
        if order == "a":
            b2 = b.permute(*range(b.dim() - 3), -2, -1, -3).reshape(*b.shape[:-3], b.shape[-2], -1)  # [*, J, e*S]
            fn = lambda a_c, n_c: self._by_rows(a_c, b2, n_c)
        else:
            fn = lambda a_c, n_c: self._outer(a_c, b, n_c)
        return chunk_apply(fn, [a, norm], [-2, -2], chunk_size, -3, accumulate_into)
