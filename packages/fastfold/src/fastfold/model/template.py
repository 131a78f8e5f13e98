"""The template pair stack (supplementary Algorithm 16)."""

from __future__ import annotations

import torch
from torch import nn

from fastfold.chunk import check_chunk_size
from fastfold.config import TemplatePairConfig
from fastfold.model.dropout import draw_dropout_seed
from fastfold.model.pair_stack import TEMPLATE_PAIR_ORDER, PairStack
from fastfold.ops import LayerNorm
from fastfold.parallel.dap import pad_axis

__all__ = ["TemplatePairBlock", "TemplatePairStack"]


class TemplatePairBlock(PairStack):
    """Triangle attentions, then triangle updates, then the pair transition (Algorithm 16)."""

    def __init__(self, cfg: TemplatePairConfig):
        super().__init__(
            cfg.c_t,
            cfg.c_hidden_tri_mul,
            cfg.c_hidden_tri_att,
            cfg.no_heads,
            cfg.pair_transition_n,
            cfg.dropout_rate,
            cfg.inf,
            TEMPLATE_PAIR_ORDER,
        )


class TemplatePairStack(nn.Module):
    """``no_blocks`` template pair blocks and the final ``layer_norm``."""

    def __init__(self, cfg: TemplatePairConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or TemplatePairConfig()
        self.blocks = nn.ModuleList([TemplatePairBlock(cfg) for _ in range(cfg.no_blocks)])
        self.layer_norm = LayerNorm(cfg.c_t)

    def _check(self, t, mask, chunk_size, inplace, dap):
        c_t = self.config.c_t
        if not isinstance(t, torch.Tensor) or t.dim() < 3 or t.shape[-1] != c_t or t.shape[-2] != t.shape[-3]:
            raise ValueError(f"t: expected [*, R, R, c_t={c_t}], got {tuple(getattr(t, 'shape', ()))}")
        mask = t.new_ones(t.shape[:-1]) if mask is None else mask.to(t.dtype)
        if tuple(mask.shape) != tuple(t.shape[:-1]):
            raise ValueError(f"mask: expected shape {tuple(t.shape[:-1])}, got {tuple(mask.shape)}")
        check_chunk_size(chunk_size)
        if inplace and torch.is_grad_enabled():
            raise ValueError("inplace=True is an inference mode: run it under torch.no_grad()")
        if dap is not None and dap.size > t.shape[-2]:
            raise ValueError(f"DAP size {dap.size} is larger than the number of residues {t.shape[-2]}")
        return mask

    def forward(self, t, mask=None, chunk_size=None, inplace=False, dap=None) -> torch.Tensor:
        """``t`` [*, N_templ, R, R, c_t], ``mask`` [*, N_templ, R, R] -> LayerNorm(blocks(t))."""
        mask = self._check(t, mask, chunk_size, inplace, dap)
        n_res = t.shape[-2]
        t = t.clone() if inplace else t
        if dap is not None:
            r_pad = dap.padded(n_res)
            t = dap.scatter(pad_axis(pad_axis(t, -3, r_pad), -2, r_pad), -3)
            mask = pad_axis(pad_axis(mask, -2, r_pad), -1, r_pad)
        layout, drop = "row", [None] * len(self.blocks)
        if self.training and self.config.dropout_rate > 0:
            drop = draw_dropout_seed(len(self.blocks), n_res, t.device, dap)  # [Note: dropout under DAP]
        for block, d in zip(self.blocks, drop):  # no switch back at a block's end: the next one starts with it
            draw = d.start(t.device) if d is not None else None
            t, layout = block(t, mask, chunk_size, inplace, dap, layout, None, draw), block.final_layout(layout)
        t = self.layer_norm(t)  # position-wise: applied to the local rows/columns under DAP
        if dap is not None:
            t = dap.gather_output(t, -3 if layout == "row" else -2)[..., :n_res, :n_res, :]
        return t
