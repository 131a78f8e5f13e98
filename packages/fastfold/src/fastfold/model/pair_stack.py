"""The pair stack shared by Evoformer, Extra-MSA and template blocks: triangle updates, triangle
attention and the pair transition, applied in a configurable order with DAP layout switches."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastfold.model.transition import PairTransition
from fastfold.model.triangle import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from fastfold.ops import bias_dropout_add

__all__ = ["PairStack", "residual_update", "EVOFORMER_PAIR_ORDER", "TEMPLATE_PAIR_ORDER"]

EVOFORMER_PAIR_ORDER = ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "pair_transition")
"""Order of the pair updates in an Evoformer block (Algorithm 6, lines 6-10)."""
TEMPLATE_PAIR_ORDER = ("tri_att_start", "tri_att_end", "tri_mul_out", "tri_mul_in", "pair_transition")
"""Order of the pair updates in a template pair block (Algorithm 16)."""

# Axis each update needs local under DAP ("row": dim -3 split, "col": dim -2 split, None: either),
# and the axis its dropout mask is shared along (row-wise: -3, column-wise: -2).
_LAYOUT = {"tri_mul_out": "row", "tri_att_start": "row", "tri_mul_in": "col", "tri_att_end": "col"}
_SHARED = {"tri_mul_out": -3, "tri_att_start": -3, "tri_mul_in": -2, "tri_att_end": -2}


def residual_update(x: torch.Tensor, update: Callable, p: float, training: bool, shared_dim, inplace: bool, draw=None):
    """``x + dropout(update(None))``, or ``update(x)`` adding into ``x`` in place (inference).
    ``draw``: the block's shared mask drawer (see [Note: dropout under DAP]); else the global RNG."""
    if inplace:
        return update(x)
    u = update(None)
    keep = draw(u, p, shared_dim) if draw is not None and training and p > 0.0 and shared_dim is not None else None
    return bias_dropout_add(u, x, p, training, shared_dim, keep=keep)


class PairStack(nn.Module):
    """Triangle multiplicative updates, triangle attentions and the pair transition."""

    def __init__(self, c_z, c_hidden_mul, c_hidden_att, no_heads, transition_n, dropout, inf, order):
        super().__init__()
        self.order, self.dropout = tuple(order), dropout
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, c_hidden_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, c_hidden_mul)
        self.tri_att_start = TriangleAttentionStartingNode(c_z, c_hidden_att, no_heads, inf)
        self.tri_att_end = TriangleAttentionEndingNode(c_z, c_hidden_att, no_heads, inf)
        self.pair_transition = PairTransition(c_z, transition_n)

    def _step(self, name, z, mask, chunk_size, inplace, dap, prepared, draw):
        module = getattr(self, name)
        if name == "pair_transition":
            fn = lambda acc: module(z, mask, chunk_size, accumulate_into=acc)
            return residual_update(z, fn, 0.0, self.training, None, inplace)
        fn = lambda acc: module(z, mask, chunk_size, dap=dap, accumulate_into=acc, prepared=prepared)
        return residual_update(z, fn, self.dropout, self.training, _SHARED[name], inplace, draw)

    def final_layout(self, layout: str = "row") -> str:
        """The DAP layout ``z`` is left in when it enters in ``layout`` and no layout is forced."""
        for name in self.order:
            layout = _LAYOUT.get(name, layout)
        return layout

    def _switch(self, name, z, mask, layout, chunk_size, dap):
        """Move ``z`` to ``layout``, pipelined with the prologue of update ``name``."""
        prepare = lambda z_p, mask_p: getattr(self, name).prepare(z_p, mask_p, chunk_size)
        with torch.profiler.record_function("fastfold.dap::pair_all_to_all"):
            if layout == "col":
                return dap.all_to_all_pipelined(z, -2, -3, mask, prepare)
            return dap.all_to_all_pipelined(z, -3, -2, mask, prepare)

    def forward(
        self, z, pair_mask, chunk_size=None, inplace=False, dap=None, layout="row", out_layout="row", draw=None
    ):
        """``z`` [*, R, R, c_z], ``pair_mask`` [*, R, R] (whole) -> new ``z``. Under DAP ``z`` has
        ``layout`` local ("row": dim -3, "col": dim -2) and is returned in ``out_layout``
        (``None``: :meth:`final_layout`, saving the last switch). ``draw``: dropout masks shared
        over the DAP group (``SharedDropout.start``; default: the global RNG)."""
        if layout not in ("row", "col") or out_layout not in ("row", "col", None):
            raise ValueError(f"layout must be 'row' or 'col' and out_layout also None; got {layout!r}, {out_layout!r}")
        for name in self.order:
            want, prepared = _LAYOUT.get(name, layout), None
            mask = pair_mask if dap is None else dap.local(pair_mask, -2 if want == "row" else -1)
            if dap is not None and want != layout:
                z, prepared = self._switch(name, z, mask, want, chunk_size, dap)
                layout = want
            with torch.profiler.record_function(f"fastfold::{name}"):
                z = self._step(name, z, mask, chunk_size, inplace, dap, prepared, draw)
        if dap is not None and out_layout is not None and layout != out_layout:
            z = dap.all_to_all(z, -3, -2) if out_layout == "row" else dap.all_to_all(z, -2, -3)
        return z
