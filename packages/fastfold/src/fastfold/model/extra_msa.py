"""The Extra-MSA stack (supplementary Algorithm 18): Evoformer blocks whose column attention is
global (Algorithm 19); only the pair representation is returned."""

from __future__ import annotations

from torch import nn

from fastfold.config import ExtraMSAConfig
from fastfold.model.evoformer import EvoformerBlock
from fastfold.model.msa import MSAColumnGlobalAttention
from fastfold.model.trunk import run_trunk

__all__ = ["ExtraMSABlock", "ExtraMSAStack"]


class ExtraMSABlock(EvoformerBlock):
    """An Evoformer block with global column attention (``msa_att_col``)."""

    def __init__(self, cfg: ExtraMSAConfig):
        col = MSAColumnGlobalAttention(cfg.c_m, cfg.c_hidden_msa_att, cfg.no_heads_msa, cfg.inf, cfg.global_eps)
        super().__init__(cfg, msa_att_col=col)


class ExtraMSAStack(nn.Module):
    """``no_blocks`` Extra-MSA blocks."""

    def __init__(self, cfg: ExtraMSAConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or ExtraMSAConfig()
        self.blocks = nn.ModuleList([ExtraMSABlock(cfg) for _ in range(cfg.no_blocks)])

    def forward(self, m, z, msa_mask=None, pair_mask=None, chunk_size=None, inplace=False, dap=None, checkpoint=False):
        """``m`` [*, S_extra, R, c_e], ``z`` [*, R, R, c_z] -> updated ``z`` (same options as
        :meth:`fastfold.model.EvoformerStack.forward`)."""
        _, z, _ = run_trunk(self.blocks, m, z, msa_mask, pair_mask, self.config, chunk_size, inplace, dap, checkpoint)
        return z
