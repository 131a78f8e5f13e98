"""Triangle multiplicative updates (supplementary Algorithms 11, 12) and triangle self-attention
around the starting and ending node (Algorithms 13, 14)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Attention, Linear
from fastfold.ops import LayerNorm, mask_bias, sigmoid_gate

__all__ = ["TriangleMultiplicativeUpdate", "TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming"]
__all__ += ["TriangleAttention", "TriangleAttentionStartingNode", "TriangleAttentionEndingNode"]


# [Note: triangle update in inference]
# Without autograd (and DAP) the update holds only two operand-sized buffers, A and B
# [*, c, R, R], besides its output: (1) chunks of z's rows are normalised and projected by ONE GEMM
# (the four a/b projections' weights concatenated), gated in place and written channels-first
# into A and B with z's rows in the middle axis (contiguous writes; LN(z) and the [*, I, J, 4c]
# projections never exist whole); (2) the product runs per block of channels as full R x R GEMMs
# (BLAS transposes the operand that needs it: outgoing A B^T, incoming A^T B) and is written over
# the block of A it has just read, so x takes A's place and the GEMMs stay large whatever the
# chunk size; (3) chunks of x's rows go through LN, linear_z and the gate (LN(z) recomputed for
# the chunk's rows) into the output or, in place, into z. Same sums as OpenFold's; the GEMM
# blocking differs, so float rounding may. With autograd (training without DAP) the same code runs
# with out-of-place gates and ``torch.cat`` instead of the buffer writes: the same kernels on the
# same layouts, so the two modes agree bit for bit ([Note: checkpointing with the inference
# forward] needs this). Under DAP (or with a ``prepared`` prologue) the projections run whole on
# the local rows (``prepare``) and the product in chunks of rows (``_combine``), in both modes.


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

    def _fused_weights(self):
        lins = (self.linear_a_p, self.linear_a_g, self.linear_b_p, self.linear_b_g)
        return torch.cat([lin.weight for lin in lins]), torch.cat([lin.bias for lin in lins])  # one GEMM

    def _project(self, z_ln, mask, chunk_size):
        """``a``, ``b`` = ``mask * sigmoid(g(LN z)) * p(LN z)`` [*, I, J, c] from one GEMM (autograd)."""
        w, bias = self._fused_weights()
        c = self.linear_a_p.out_features

        def fn(z_c, mask_c):
            p_a, g_a, p_b, g_b = F.linear(z_c, w, bias).split(c, dim=-1)
            mask_c = mask_c.unsqueeze(-1)
            return torch.cat([sigmoid_gate(p_a, g_a) * mask_c, sigmoid_gate(p_b, g_b) * mask_c], dim=-1)

        ab = chunk_apply(fn, [z_ln, mask], [-3, -2], chunk_size, -3)  # [*, I, J, 2c]
        return ab.chunk(2, dim=-1)

    def _operands(self, z, mask, chunk_size):
        """Channels-first operands ``A``, ``B`` [*, c, rows of z, cols of z] written chunk by chunk of
        ``z``'s rows (see [Note: triangle update in inference]); concatenated under autograd."""
        # unchunked: still 8 row blocks (the [*, rows, J, 4c] projection is the largest transient;
        # GEMMs of R/8 x R rows are as fast as one)
        n = z.shape[-3]
        step = max(1, -(-n // 8)) if chunk_size is None else chunk_size
        c = self.linear_a_p.out_features
        w, bias = self._fused_weights()
        grad = torch.is_grad_enabled()
        a_all = b_all = None
        a_parts, b_parts = [], []
        for start in range(0, n, step):
            rows = min(step, n - start)
            z_c, mask_c = z.narrow(-3, start, rows), mask.narrow(-2, start, rows).unsqueeze(-1)
            p_a, g_a, p_b, g_b = F.linear(self.layer_norm_in(z_c), w, bias).split(c, dim=-1)  # [*, rows, J, c]
            if grad:
                a_parts.append((torch.sigmoid(g_a) * p_a * mask_c).movedim(-1, -3))  # [*, c, rows, J]
                b_parts.append((torch.sigmoid(g_b) * p_b * mask_c).movedim(-1, -3))
                continue
            a_c = g_a.sigmoid_().mul_(p_a).mul_(mask_c).movedim(-1, -3)  # [*, c, rows, J]
            b_c = g_b.sigmoid_().mul_(p_b).mul_(mask_c).movedim(-1, -3)
            if a_all is None:
                a_all = z.new_empty((*z.shape[:-3], c, n, z.shape[-2]))
                b_all = torch.empty_like(a_all)
            a_all.narrow(-2, start, rows).copy_(a_c)
            b_all.narrow(-2, start, rows).copy_(b_c)
        if grad:
            return torch.cat(a_parts, dim=-2), torch.cat(b_parts, dim=-2)
        return a_all, b_all

    def _product_into_a(self, a_all, b_all, block: int = 8):
        """``x`` [*, c, I, J] written over ``a_all`` ``block`` channels at a time: outgoing
        ``x = A B^T`` (``x_ij = sum_k a_ik b_jk``), incoming ``x = A^T B`` (``sum_k a_ki b_kj``);
        under autograd the blocks are concatenated instead."""
        c = a_all.shape[-3]
        grad = torch.is_grad_enabled()
        parts = []
        for start in range(0, c, block):
            a_c, b_c = a_all.narrow(-3, start, min(block, c - start)), b_all.narrow(-3, start, min(block, c - start))
            x_c = a_c @ b_c.transpose(-1, -2) if self.outgoing else a_c.transpose(-1, -2) @ b_c
            if grad:
                parts.append(x_c)
            else:
                a_c.copy_(x_c)  # a_c was read whole by the product above
        return torch.cat(parts, dim=-3) if grad else a_all

    def _lean(self, z, mask, chunk_size, accumulate_into):
        a_all, b_all = self._operands(z, mask, chunk_size)
        x = self._product_into_a(a_all, b_all)  # [*, c, I, J]
        del a_all, b_all
        fn = lambda x_c, z_c: self._finish(x_c.movedim(-3, -1), z_c)
        return chunk_apply(fn, [x, z], [-2, -3], chunk_size, -3, accumulate_into)

    def _finish(self, x, z_c):
        """``sigmoid(linear_g(LN_in(z))) * linear_z(LN_out(x))`` for rows ``z_c`` (LN recomputed per chunk)."""
        x = self.linear_z(self.layer_norm_out(x))
        if torch.is_grad_enabled():
            return torch.sigmoid(self.linear_g(self.layer_norm_in(z_c))) * x
        return self.linear_g(self.layer_norm_in(z_c)).sigmoid_().mul_(x)

    def _combine(self, a_c, b_t, z_ln):
        x = (a_c @ b_t).movedim(-3, -1)  # [*, c, I_c, K] @ [*, c, K, J] -> [*, I_c, J, c]
        x = self.linear_z(self.layer_norm_out(x))
        if torch.is_grad_enabled():
            return sigmoid_gate(x, self.linear_g(z_ln))
        return self.linear_g(z_ln).sigmoid_().mul_(x)

    def prepare(self, z, mask, chunk_size=None) -> tuple[torch.Tensor, ...]:
        """The position-wise prologue ``(LN(z), a, b)`` [*, I, J, *]; it runs on slices of ``z``
        while the rest of it is still being transferred (see ``Dap.all_to_all_pipelined``)."""
        z_ln = self.layer_norm_in(z)
        return (z_ln, *self._project(z_ln, mask, chunk_size))

    def forward(self, z, mask, chunk_size=None, dap=None, accumulate_into=None, prepared=None) -> torch.Tensor:
        """``z`` [*, I, J, c_z], ``mask`` [*, I, J] -> update [*, I, J, c_z]. Under DAP the rows
        (outgoing) or columns (incoming) are local; the operand needed whole is all-gathered.
        ``prepared``: :meth:`prepare` already computed on this ``z``."""
        if dap is None and prepared is None:  # [Note: triangle update in inference], also with autograd
            return self._lean(z, mask, chunk_size, accumulate_into)
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
        del a, b, pending, prepared  # [*, c, I, K] and [*, c, K, J] replace them
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
        if prepared is None and dap is None:
            # LN(z) is recomputed per chunk rather than held whole (the bias needs one pass over it)
            bias = chunk_apply(lambda z_c: self.linear(self.layer_norm(z_c)), [z], [-3], chunk_size, -3)
            z_ln, attend = z, lambda z_c, kb_c: self.mha(*(2 * [self.layer_norm(z_c)]), [kb_c, bias])
        else:
            z_ln, bias = prepared if prepared is not None else self.prepare(z)  # [*, I, J, c], [*, I, J, H]
            attend = lambda z_c, kb_c: self.mha(z_c, z_c, [kb_c, bias])
        if not self.starting:  # position-wise prologue: transposing after it is the same
            z_ln, bias, mask = z_ln.transpose(-2, -3), bias.transpose(-2, -3), mask.transpose(-1, -2)
            acc = acc.transpose(-2, -3) if acc is not None else None
        pending = dap.gather_async(bias, -3) if dap is not None else None
        key_bias = mask_bias(mask, self.inf)[..., :, None, None, :]  # [*, I, 1, 1, K]
        bias = bias if pending is None else pending.wait()
        bias = bias.movedim(-1, -3).contiguous().unsqueeze(-4)  # [*, 1, H, J, K], read by every chunk
        out = chunk_apply(lambda z_c, kb_c: attend(z_c, kb_c), [z_ln, key_bias], [-3, -4], chunk_size, -3, acc)
        return out.transpose(-2, -3) if not self.starting else out


class TriangleAttentionStartingNode(TriangleAttention):
    """Algorithm 13: attention along ``j`` for each ``i``, biased by ``b_jk``."""

    starting = True


class TriangleAttentionEndingNode(TriangleAttention):
    """Algorithm 14: attention along ``i`` for each ``j``, biased by ``b_ki``."""

    starting = False
