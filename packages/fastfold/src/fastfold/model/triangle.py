"""Triangle multiplicative updates (supplementary Algorithms 11, 12) and triangle self-attention
around the starting and ending node (Algorithms 13, 14)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastfold.chunk import chunk_apply
from fastfold.model.primitives import Attention, Linear
from fastfold.ops import LayerNorm, mask_bias

__all__ = ["TriangleMultiplicativeUpdate", "TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming"]
__all__ += ["TriangleAttention", "TriangleAttentionStartingNode", "TriangleAttentionEndingNode"]


# [Note: triangle update in inference]
# Without autograd (and DAP) the update holds only two operand-sized buffers, A and B
# [*, c, R, R], besides its output: (1) chunks of z's rows are normalised and projected by ONE GEMM
# (the four a/b projections' weights concatenated) computed as ``W @ LN(z)^T``, so the projection
# comes out channels-first [*, 4c, rows, J]: each of a/b and their gates is a dense block, gated in
# place and copied into A and B with z's rows in the middle axis (no permuting copy; LN(z) and the
# projections never exist whole). Unchunked, a block holds up to _BLOCK_BYTES of projection and at
# least R/8 rows; at small R (training crops) one block covers every row and A, B are its gated
# blocks, no copy. (2) The product runs per block of channels (at least 8, up to _PRODUCT_BYTES)
# as full R x R GEMMs (BLAS transposes the operand that needs it: outgoing A B^T, incoming A^T B)
# and is written over the block of A it has just read, so x takes A's place and the GEMMs stay
# large whatever the chunk size; (3) chunks of x's rows are copied channels-last (``_ChannelsLast``:
# its gradient goes back dense channels-first, so the product's backward GEMMs run batched without
# a copy per matrix) and go through LN, linear_z and the gate (LN(z) recomputed for the chunk's
# rows, or reused when one block covered them all) into the output or, in place, into z. Same sums
# as OpenFold's; the GEMM blocking differs, so float rounding may. With autograd (training without
# DAP) the same code runs with out-of-place gates and ``torch.cat`` instead of the buffer writes:
# the same kernels on the same layouts, so the two modes agree bit for bit ([Note: checkpointing
# with the inference forward] needs this). Under DAP (or with a ``prepared`` prologue) the
# projections run whole on the local rows (``prepare``, channels-first too: the gathered operand
# moves and the pipelined all-to-all reassembles it without a permuting copy) and the product in
# chunks of rows (``_combine``), in both modes.


_BLOCK_BYTES = 16 * 2**20  # unchunked: row blocks of the fused projection up to this size
_PRODUCT_BYTES = 4 * 2**20  # channel blocks of the product up to this size


def _linear_channels_first(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x`` [*, I, J, c_in], computed as ``w @ x^T`` so the result is
    channels-first [*, c_out, I, J] and contiguous: each output channel block is a dense operand
    for the batched GEMMs and the gates, with no permuting copy."""
    flat = x.reshape(-1, x.shape[-3] * x.shape[-2], x.shape[-1])  # [B, I*J, c_in]
    if flat.shape[0] == 1:
        out = torch.addmm(bias.unsqueeze(-1), w, flat[0].transpose(-1, -2))
    else:  # one explicit kernel in both modes (torch.matmul's broadcasting path may depend on autograd)
        out = torch.baddbmm(bias.unsqueeze(-1), w.expand(flat.shape[0], *w.shape), flat.transpose(-1, -2))
    return out.view(*x.shape[:-3], w.shape[0], *x.shape[-3:-1])


class _ChannelsLast(torch.autograd.Function):
    """``x`` [*, c, I, J] -> contiguous [*, I, J, c]; the gradient goes back contiguous
    channels-first, the layout the product's batched GEMMs take without a copy per matrix."""

    @staticmethod
    def forward(ctx, x):
        return x.movedim(-3, -1).contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.movedim(-1, -3).contiguous()


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _ChannelsLast.apply(x)
    return x.movedim(-3, -1).contiguous()


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
        """The four a/b projections as one GEMM, ordered ``a_p, b_p, a_g, b_g`` so that the gated
        ``[a, b]`` is one elementwise pass over the halves of the projection."""
        lins = (self.linear_a_p, self.linear_b_p, self.linear_a_g, self.linear_b_g)
        return torch.cat([lin.weight for lin in lins]), torch.cat([lin.bias for lin in lins])

    def _gated(self, z_ln, mask, w, bias):
        """Channels-first ``[a; b]`` = ``mask * sigmoid(g(z_ln)) * p(z_ln)`` [*, 2c, I, J] for
        ``z_ln`` [*, I, J, c_z] and ``mask`` [*, I, J] (in place of the gate half without autograd)."""
        p, g = _linear_channels_first(z_ln, w, bias).chunk(2, dim=-3)  # [*, 2c, I, J] each
        mask = mask.unsqueeze(-3)
        if torch.is_grad_enabled():
            return torch.sigmoid(g) * p * mask
        return g.sigmoid_().mul_(p).mul_(mask)

    def _operands(self, z, mask, chunk_size):
        """Channels-first operands ``A``, ``B`` [*, c, rows of z, cols of z] written chunk by chunk of
        ``z``'s rows (see [Note: triangle update in inference]); concatenated under autograd. Also
        ``LN(z)`` when one block covered all rows (``None`` otherwise)."""
        # unchunked: row blocks of at least R/8 rows and of up to _BLOCK_BYTES of projection (the
        # [*, 4c, rows, J] projection is the largest transient), one block at small R
        n = z.shape[-3]
        c = self.linear_a_p.out_features
        step = chunk_size
        if chunk_size is None:
            step = max(-(-n // 8), _BLOCK_BYTES // max(1, z[..., :1, :, :1].numel() * 4 * c * z.element_size()), 1)
        w, bias = self._fused_weights()
        grad = torch.is_grad_enabled()
        a_all = b_all = z_ln = None
        a_parts, b_parts = [], []
        for start in range(0, n, step):
            rows = min(step, n - start)
            z_c, mask_c = z.narrow(-3, start, rows), mask.narrow(-2, start, rows)
            z_ln = self.layer_norm_in(z_c)
            a_c, b_c = self._gated(z_ln, mask_c, w, bias).chunk(2, dim=-3)  # [*, c, rows, J]
            if grad:
                a_parts.append(a_c)
                b_parts.append(b_c)
                continue
            if rows == n:  # one block: A and B are these
                return a_c, b_c, z_ln
            if a_all is None:
                a_all = z.new_empty((*z.shape[:-3], c, n, z.shape[-2]))
                b_all = torch.empty_like(a_all)
            a_all.narrow(-2, start, rows).copy_(a_c)
            b_all.narrow(-2, start, rows).copy_(b_c)
        if grad:
            if len(a_parts) == 1:
                return a_parts[0], b_parts[0], z_ln
            return torch.cat(a_parts, dim=-2), torch.cat(b_parts, dim=-2), None
        return a_all, b_all, None

    def _product_into_a(self, a_all, b_all):
        """``x`` [*, c, I, J] written over ``a_all`` a block of channels at a time: outgoing
        ``x = A B^T`` (``x_ij = sum_k a_ik b_jk``), incoming ``x = A^T B`` (``sum_k a_ki b_kj``);
        under autograd the blocks are concatenated instead."""
        c = a_all.shape[-3]
        # at least 8 channels, as many as fit _PRODUCT_BYTES of product (z is square)
        block = max(8, _PRODUCT_BYTES // max(1, a_all[..., :1, :, :].numel() * a_all.element_size()))
        grad = torch.is_grad_enabled()
        parts = []
        for start in range(0, c, block):
            a_c, b_c = a_all.narrow(-3, start, min(block, c - start)), b_all.narrow(-3, start, min(block, c - start))
            x_c = a_c @ b_c.transpose(-1, -2) if self.outgoing else a_c.transpose(-1, -2) @ b_c
            if grad or block >= c:
                parts.append(x_c)  # one block: x is the product itself (no copy)
            else:
                a_c.copy_(x_c)  # a_c was read whole by the product above
        if parts:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-3)
        return a_all

    def _lean(self, z, mask, chunk_size, accumulate_into):
        a_all, b_all, z_ln = self._operands(z, mask, chunk_size)
        x = self._product_into_a(a_all, b_all)  # [*, c, I, J]
        del a_all, b_all
        if z_ln is not None:  # one block covered every row: LN(z) is at hand
            return self._finish(x, z_ln, accumulate_into)
        fn = lambda x_c, z_c: self._finish(x_c, self.layer_norm_in(z_c))
        return chunk_apply(fn, [x, z], [-2, -3], chunk_size, -3, accumulate_into)

    def _finish(self, x, z_ln, accumulate_into=None):
        """``sigmoid(linear_g(z_ln)) * linear_z(LN_out(x))`` for channels-first ``x`` [*, c, I, J] and
        ``z_ln`` = ``LN_in(z)`` of the same rows [*, I, J, c_z]."""
        x = self.linear_z(self.layer_norm_out(_channels_last(x)))
        if torch.is_grad_enabled():
            out = torch.sigmoid(self.linear_g(z_ln)) * x
        else:
            out = self.linear_g(z_ln).sigmoid_().mul_(x)
        return out if accumulate_into is None else accumulate_into.add_(out)

    def _combine(self, a_c, b_t, z_ln):
        """The update for a chunk of rows: ``a_c`` [*, c, I_c, K] @ ``b_t`` [*, c, K, J], then
        :meth:`_finish` with ``z_ln`` [*, I_c, J, c_z]."""
        return self._finish(a_c @ b_t, z_ln)

    def prepare(self, z, mask, chunk_size=None) -> tuple[torch.Tensor, ...]:
        """The position-wise prologue ``(LN(z), a, b)`` [*, I, J, *]; it runs on slices of ``z``
        while the rest of it is still being transferred (see ``Dap.all_to_all_pipelined``). ``a``
        and ``b`` are channels-last views of dense channels-first storage (see
        :func:`_linear_channels_first`)."""
        z_ln = self.layer_norm_in(z)
        w, bias = self._fused_weights()
        fn = lambda z_c, mask_c: self._gated(z_c, mask_c, w, bias)
        ab = chunk_apply(fn, [z_ln, mask], [-3, -2], chunk_size, -2)  # [*, 2c, I, J], chunks of rows
        return (z_ln, *ab.movedim(-3, -1).chunk(2, dim=-1))

    def forward(self, z, mask, chunk_size=None, dap=None, accumulate_into=None, prepared=None) -> torch.Tensor:
        """``z`` [*, I, J, c_z], ``mask`` [*, I, J] -> update [*, I, J, c_z]. Under DAP the rows
        (outgoing) or columns (incoming) are local; the operand needed whole is all-gathered.
        ``prepared``: :meth:`prepare` already computed on this ``z``."""
        if dap is None and prepared is None:  # [Note: triangle update in inference], also with autograd
            return self._lean(z, mask, chunk_size, accumulate_into)
        z_ln, a, b = prepared if prepared is not None else self.prepare(z, mask, chunk_size)
        a, b = a.movedim(-1, -3), b.movedim(-1, -3)  # channels-first [*, c, I, J], dense (see prepare)
        # outgoing x_ij = sum_k a_ik b_jk; incoming x_ij = sum_k a_ki b_kj. Under DAP the operand
        # needed whole is gathered; BLAS reads the transposed one as it is.
        if self.outgoing:
            pending = dap.gather_async(b, -2) if dap is not None else None
            b = b if pending is None else pending.wait()
            a_t, b_t = a, b.transpose(-1, -2)
        else:
            pending = dap.gather_async(a, -1) if dap is not None else None
            a = a if pending is None else pending.wait()
            a_t, b_t = a.transpose(-1, -2), b
        del a, b, pending, prepared
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
        if prepared is None and dap is None and chunk_size is not None:
            # LN(z) is recomputed per chunk rather than held whole (the bias needs one pass over it);
            # unchunked, LN(z) is computed once (the logits dwarf it)
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
