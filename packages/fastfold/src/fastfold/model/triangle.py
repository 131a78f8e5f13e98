"""Triangle multiplicative updates (supplementary Algorithms 11, 12) and triangle self-attention
around the starting and ending node (Algorithms 13, 14)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Attention, Linear
from fastfold.ops import LayerNorm, mask_bias, sigmoid_gate

__all__ = ["TriangleMultiplicativeUpdate", "TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming"]
__all__ += ["TriangleAttention", "TriangleAttentionStartingNode", "TriangleAttentionEndingNode"]


class TriangleMultiplicativeUpdate(nn.Module):
    """``z_ij <- g_ij * Linear(LN(sum_k a_ik b_jk))`` (outgoing) or ``sum_k a_ki b_kj`` (incoming)."""

    outgoing: bool = True

    def __init__(self, c_z: int, c_hidden: int):
        super().__init__()
        self.layer_norm_in = LayerNorm(c_z)
        self.layer_norm_out = LayerNorm(c_hidden)
        self.linear_a_p = Linear(c_z, c_hidden)
        self.linear_a_g = Linear(c_z, c_hidden, init="gating")
        self.linear_b_p = Linear(c_z, c_hidden)
        self.linear_b_g = Linear(c_z, c_hidden, init="gating")
        self.linear_g = Linear(c_z, c_z, init="gating")
        self.linear_z = Linear(c_hidden, c_z, init="final")

    def _project(self, z_ln, mask, chunk_size):
        def fn(z_c, mask_c):
            mask_c = mask_c.unsqueeze(-1)
            a = sigmoid_gate(self.linear_a_p(z_c), self.linear_a_g(z_c)) * mask_c
            return torch.cat([a, sigmoid_gate(self.linear_b_p(z_c), self.linear_b_g(z_c)) * mask_c], dim=-1)

        ab = chunk_apply(fn, [z_ln, mask], [-3, -2], chunk_size, -3)  # [*, I, J, 2c]
        return ab.chunk(2, dim=-1)

    def _combine(self, a_c, b_t, z_c):
        x = (a_c @ b_t).movedim(-3, -1)  # [*, c, I_c, K] @ [*, c, K, J] -> [*, I_c, J, c]
        return sigmoid_gate(self.linear_z(self.layer_norm_out(x)), self.linear_g(z_c))

    def prepare(self, z, mask, chunk_size=None) -> tuple[torch.Tensor, ...]:
        """The position-wise prologue ``(LN(z), a, b)`` [*, I, J, *]; it runs on slices of ``z``
        while the rest of it is still being transferred (see ``Dap.all_to_all_pipelined``)."""
        z_ln = self.layer_norm_in(z)
        return (z_ln, *self._project(z_ln, mask, chunk_size))

    def forward(self, z, mask, chunk_size=None, dap=None, accumulate_into=None, prepared=None) -> torch.Tensor:
        """``z`` [*, I, J, c_z], ``mask`` [*, I, J] -> update [*, I, J, c_z]. Under DAP the rows
        (outgoing) or columns (incoming) are local; the operand needed whole is all-gathered.
        ``prepared``: :meth:`prepare` already computed on this ``z``."""
        z_ln, a, b = prepared if prepared is not None else self.prepare(z, mask, chunk_size)
        # Channels-first operands, permuted once for all chunks:
        # outgoing x_ij = sum_k a_ik b_jk; incoming x_ij = sum_k a_ki b_kj. Under DAP the operand
        # needed whole is gathered while the local one is permuted.
        if self.outgoing:
            pending = dap.gather_async(b, -3) if dap is not None else None
            a_t = a.movedim(-1, -3).contiguous()
            b = b if pending is None else pending.wait()
            b_t = b.movedim(-1, -3).transpose(-1, -2).contiguous()
        else:
            pending = dap.gather_async(a, -2) if dap is not None else None
            b_t = b.movedim(-1, -3).contiguous()
            a = a if pending is None else pending.wait()
            a_t = a.movedim(-1, -3).transpose(-1, -2).contiguous()
        del a, b, pending  # [*, c, I, K] and [*, c, K, J] replace them
        fn = lambda a_c, z_c: self._combine(a_c, b_t, z_c)
        return chunk_apply(fn, [a_t, z_ln], [-2, -3], chunk_size, -3, accumulate_into)


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Algorithm 11: edges ``ik`` and ``jk`` update ``ij``."""

    outgoing = True


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Algorithm 12: edges ``ki`` and ``kj`` update ``ij``."""

    outgoing = False


class TriangleAttention(nn.Module):
    """Row-wise gated attention over the pair representation with a third-edge bias ``b_jk``;
    the ending-node form runs on the transpose."""

    starting: bool = True

    def __init__(self, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9):
        super().__init__()
        self.inf = inf
        self.layer_norm = LayerNorm(c_z)
        self.linear = Linear(c_z, no_heads, bias=False)
        nn.init.normal_(self.linear.weight, std=1.0 / math.sqrt(c_z))
        self.mha = Attention(c_z, c_z, c_hidden, no_heads)

    def prepare(self, z, mask=None, chunk_size=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The position-wise prologue ``(LN(z), bias)`` [*, I, J, *] in ``z``'s own layout (see
        :meth:`TriangleMultiplicativeUpdate.prepare`)."""
        z_ln = self.layer_norm(z)
        return z_ln, self.linear(z_ln)

    def forward(self, z, mask, chunk_size=None, dap=None, accumulate_into=None, prepared=None) -> torch.Tensor:
        """``z`` [*, I, J, c_z], ``mask`` [*, I, J] -> update [*, I, J, c_z]. Under DAP rows (starting)
        or columns (ending) are local and the bias is all-gathered. ``prepared``: :meth:`prepare`."""
        acc = accumulate_into
        z_ln, bias = prepared if prepared is not None else self.prepare(z)  # [*, I, J, c], [*, I, J, H]
        if not self.starting:  # position-wise prologue: transposing after it is the same
            z_ln, bias, mask = z_ln.transpose(-2, -3), bias.transpose(-2, -3), mask.transpose(-1, -2)
            acc = acc.transpose(-2, -3) if acc is not None else None
        pending = dap.gather_async(bias, -3) if dap is not None else None
        key_bias = mask_bias(mask, self.inf)[..., :, None, None, :]  # [*, I, 1, 1, K]
        bias = bias if pending is None else pending.wait()
        bias = bias.movedim(-1, -3).unsqueeze(-4)  # [*, 1, H, J, K]
        fn = lambda z_c, kb_c: self.mha(z_c, z_c, [kb_c, bias])
        out = chunk_apply(fn, [z_ln, key_bias], [-3, -4], chunk_size, -3, acc)
        return out.transpose(-2, -3) if not self.starting else out


class TriangleAttentionStartingNode(TriangleAttention):
    """Algorithm 13: attention along ``j`` for each ``i``, biased by ``b_jk``."""

    starting = True


class TriangleAttentionEndingNode(TriangleAttention):
    """Algorithm 14: attention along ``i`` for each ``j``, biased by ``b_ki``."""

    starting = False
