"""Building blocks shared by the Evoformer modules: initialised linear layers, gated multi-head
attention (supplementary Algorithm 7/8 core) and global attention (Algorithm 19 core)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastfold.ops import attention_core, sigmoid_gate, softmax_with_biases

__all__ = ["Linear", "Attention", "GlobalAttention"]


class Linear(nn.Linear):
    """``nn.Linear`` with AlphaFold's initialisers: ``default`` (LeCun normal), ``relu`` (He normal),
    ``final`` (zeros), ``gating`` (zero weight, bias 1)."""

    def __init__(self, c_in: int, c_out: int, bias: bool = True, init: str = "default"):
        super().__init__(c_in, c_out, bias=bias)
        if init not in ("default", "relu", "final", "gating"):
            raise ValueError(f"init must be one of default, relu, final, gating; got {init!r}")
        with torch.no_grad():
            if init in ("default", "relu"):
                scale = 2.0 if init == "relu" else 1.0
                nn.init.trunc_normal_(self.weight, std=math.sqrt(scale / c_in))
            else:
                self.weight.zero_()
            if bias:
                self.bias.fill_(1.0 if init == "gating" else 0.0)


class Attention(nn.Module):
    """Gated multi-head attention; parameters named as in OpenFold (``linear_q/k/v/o/g``)."""

    def __init__(self, c_q: int, c_kv: int, c_hidden: int, no_heads: int, gating: bool = True):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        hd = c_hidden * no_heads
        self.linear_q = Linear(c_q, hd, bias=False)
        self.linear_k = Linear(c_kv, hd, bias=False)
        self.linear_v = Linear(c_kv, hd, bias=False)
        self.linear_o = Linear(hd, c_q, init="final")
        self.linear_g = Linear(c_q, hd, init="gating") if gating else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [*, N, H*d] -> [*, H, N, d]
        return x.view(*x.shape[:-1], self.no_heads, self.c_hidden).transpose(-2, -3)

    def forward(self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``q_x`` [*, Q, c_q], ``kv_x`` [*, K, c_kv], biases broadcast to [*, H, Q, K] -> [*, Q, c_q]."""
        if q_x is kv_x:
            return self._self_attention(q_x, biases)
        q = self._heads(self.linear_q(q_x)) / math.sqrt(self.c_hidden)  # [*, H, Q, d]
        k = self._heads(self.linear_k(kv_x))  # [*, H, K, d]
        v = self._heads(self.linear_v(kv_x))  # [*, H, K, d]
        o = attention_core(q, k, v, biases).transpose(-2, -3)  # [*, Q, H, d]
        if self.linear_g is not None and not torch.is_grad_enabled():
            o = self.linear_g(q_x).view(o.shape).sigmoid_().mul_(o)  # inference: gate in place
        elif self.linear_g is not None:
            o = sigmoid_gate(o, self.linear_g(q_x).view(o.shape))
        return self.linear_o(o.reshape(*o.shape[:-2], -1))

    def _self_attention(self, x: torch.Tensor, biases: Sequence[torch.Tensor]) -> torch.Tensor:
        """Self-attention with the q, k, v and gate projections as one GEMM of the concatenated
        weights (one kernel instead of four, forward and backward), the query scaling folded into
        ``W_q`` and the gate's bias into the GEMM. With and without autograd every kernel sees
        tensors of the same layout (``q``, ``k``, ``v`` and the gate as strided slices of the one
        projection, a fresh dense gated output for ``linear_o``), so the two modes agree bit for
        bit, which [Note: checkpointing with the inference forward] needs: the fused attention's
        internal GEMMs and ``F.linear`` (addmm for a dense input, matmul + bias add for a strided
        one) round differently for other strides."""
        grad = torch.is_grad_enabled()
        hd = self.linear_q.out_features
        weights = [self.linear_q.weight / math.sqrt(self.c_hidden), self.linear_k.weight, self.linear_v.weight]
        bias = None
        if self.linear_g is not None:
            weights.append(self.linear_g.weight)
            bias = torch.cat([self.linear_g.bias.new_zeros(3 * hd), self.linear_g.bias])
        qkvg = F.linear(x, torch.cat(weights), bias).split(hd, dim=-1)
        o = attention_core(*(self._heads(t) for t in qkvg[:3]), biases).transpose(-2, -3)  # [*, Q, H, d]
        if self.linear_g is not None:
            gate = torch.sigmoid(qkvg[3]).view(o.shape)  # dense; the projection is freed here
            del qkvg
            o = gate * o if grad else gate.mul_(o)
        return self.linear_o(o.reshape(*o.shape[:-2], -1))


class GlobalAttention(nn.Module):
    """Global gated attention of Algorithm 19: one averaged query per head, one shared key/value head."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, inf: float, eps: float):
        super().__init__()
        self.c_hidden, self.no_heads, self.inf, self.eps = c_hidden, no_heads, inf, eps
        self.linear_q = Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_k = Linear(c_in, c_hidden, bias=False)
        self.linear_v = Linear(c_in, c_hidden, bias=False)
        self.linear_g = Linear(c_in, c_hidden * no_heads, init="gating")
        self.linear_o = Linear(c_hidden * no_heads, c_in, init="final")

    def forward(self, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``m`` [*, R, S, c] attended along S (per column r), ``mask`` [*, R, S] -> [*, R, S, c]."""
        q = (m * mask.unsqueeze(-1)).sum(-2) / (mask.sum(-1, keepdim=True) + self.eps)  # [*, R, c]
        q = self.linear_q(q).view(*q.shape[:-1], self.no_heads, self.c_hidden) / math.sqrt(self.c_hidden)
        k, v = self.linear_k(m), self.linear_v(m)  # [*, R, S, d]
        bias = (self.inf * (mask - 1)).unsqueeze(-2)  # [*, R, 1, S]
        a = softmax_with_biases(q @ k.transpose(-1, -2), [bias], inplace=True)  # [*, R, H, S]
        o = a @ v  # [*, R, H, d]
        g = self.linear_g(m).view(*m.shape[:-1], self.no_heads, self.c_hidden)  # [*, R, S, H, d]
        o = sigmoid_gate(o.unsqueeze(-3), g)  # [*, R, S, H, d]
        return self.linear_o(o.reshape(*o.shape[:-2], -1))
