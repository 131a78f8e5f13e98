"""The Evoformer block and stack (supplementary Algorithm 6)."""

from __future__ import annotations

import torch
from torch import nn

from fastfold.autochunk import choose_chunk_size
from fastfold.config import EvoformerConfig
from fastfold.model.msa import MSAColumnAttention, MSARowAttentionWithPairBias
from fastfold.model.outer_product_mean import OuterProductMean
from fastfold.model.pair_stack import EVOFORMER_PAIR_ORDER, PairStack, residual_update
from fastfold.model.transition import MSATransition
from fastfold.model.trunk import run_trunk
from fastfold.parallel.dap import PAIR_A2A_TAG, pad_axis

__all__ = ["EvoformerBlock", "EvoformerStack"]


class EvoformerBlock(nn.Module):
    """One Evoformer block: MSA stack, outer product mean, pair stack (names as in OpenFold)."""

    def __init__(self, cfg: EvoformerConfig, msa_att_col: nn.Module | None = None):
        super().__init__()
        self.msa_dropout = cfg.msa_dropout
        self.msa_att_row = MSARowAttentionWithPairBias(
            cfg.c_m, cfg.c_z, cfg.c_hidden_msa_att, cfg.no_heads_msa, cfg.inf
        )
        if msa_att_col is None:
            msa_att_col = MSAColumnAttention(cfg.c_m, cfg.c_hidden_msa_att, cfg.no_heads_msa, cfg.inf)
        self.msa_att_col = msa_att_col
        self.msa_transition = MSATransition(cfg.c_m, cfg.transition_n)
        self.outer_product_mean = OuterProductMean(cfg.c_m, cfg.c_z, cfg.c_hidden_opm, cfg.opm_eps)
        self.pair_stack = PairStack(
            cfg.c_z,
            cfg.c_hidden_mul,
            cfg.c_hidden_pair_att,
            cfg.no_heads_pair,
            cfg.transition_n,
            cfg.pair_dropout,
            cfg.inf,
            EVOFORMER_PAIR_ORDER,
        )

    def _msa_stack(self, m, z, msa_mask, chunk_size, inplace, dap, draw):
        seq_mask = msa_mask if dap is None else dap.local(msa_mask, -2)
        res_mask = msa_mask if dap is None else dap.local(msa_mask, -1)
        with torch.profiler.record_function("fastfold::msa_att_row"):
            fn = lambda acc: self.msa_att_row(m, z, seq_mask, chunk_size, dap=dap, accumulate_into=acc, z_split_dim=-2)
            m = residual_update(m, fn, self.msa_dropout, self.training, -3, inplace, draw)
        if dap is not None:
            with torch.profiler.record_function("fastfold.dap::msa_seq_to_res"):
                m = dap.all_to_all(m, -2, -3)  # [*, S, R_loc, c]
        with torch.profiler.record_function("fastfold::msa_att_col"):
            fn = lambda acc: self.msa_att_col(m, res_mask, chunk_size, accumulate_into=acc)
            m = residual_update(m, fn, 0.0, self.training, None, inplace)
        with torch.profiler.record_function("fastfold::msa_transition"):
            fn = lambda acc: self.msa_transition(m, res_mask, chunk_size, accumulate_into=acc)
            m = residual_update(m, fn, 0.0, self.training, None, inplace)
        return m, res_mask

    def forward(self, m, z, msa_mask, pair_mask, chunk_size=None, inplace=False, dap=None, dropout=None):
        """``m`` [*, S, R, c_m] (S local under DAP), ``z`` [*, R, R, c_z] (columns local), masks whole
        (padded) [*, S, R] and [*, R, R] -> new ``(m, z)`` in the same layouts. ``dropout``: a
        :class:`fastfold.model.dropout.SharedDropout` (masks equal over the DAP group)."""
        draw = dropout.start(m.device) if dropout is not None else None
        # [Note: overlapping the pair all-to-alls] (fastfold.parallel.dap): z moves to the row split
        # while the MSA stack runs; only the row-attention bias (position-wise) reads it before.
        pending_z = dap.all_to_all_async(z, -3, -2, PAIR_A2A_TAG) if dap is not None else None
        m, res_mask = self._msa_stack(m, z, msa_mask, chunk_size, inplace, dap, draw)
        z = pending_z.wait() if pending_z is not None else z  # [*, R_loc, R, c_z]
        with torch.profiler.record_function("fastfold::outer_product_mean"):
            fn = lambda acc: self.outer_product_mean(m, res_mask, chunk_size, dap, acc, mask_all=msa_mask)
            z = residual_update(z, fn, 0.0, self.training, None, inplace)
        pending = dap.all_to_all_async(m, -3, -2) if dap is not None else None  # back to S local, overlapped
        z = self.pair_stack(z, pair_mask, chunk_size, inplace, dap, "row", "col", draw)
        return (pending.wait() if pending is not None else m), z


class EvoformerStack(nn.Module):
    """``no_blocks`` Evoformer blocks and the single-representation projection ``linear``."""

    def __init__(self, cfg: EvoformerConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or EvoformerConfig()
        self.blocks = nn.ModuleList([EvoformerBlock(cfg) for _ in range(cfg.no_blocks)])
        self.linear = nn.Linear(cfg.c_m, cfg.c_s)

    def _auto_chunk(self, m, msa_mask, pair_mask, chunk_size, inplace, max_memory):
        """The chunk size for ``max_memory`` (see [Note: choosing the chunk size]); under DAP the
        estimate is that of one rank holding everything (an upper bound)."""
        if chunk_size is not None:
            raise ValueError(f"give chunk_size or max_memory, not both (got chunk_size={chunk_size})")
        masked = any(mask is not None and not bool(mask.all()) for mask in (msa_mask, pair_mask))
        return choose_chunk_size(self.config, m.shape[-3], m.shape[-2], max_memory, inplace, masked)

    def forward(
        self,
        m,
        z,
        msa_mask=None,
        pair_mask=None,
        chunk_size=None,
        inplace=False,
        dap=None,
        checkpoint=False,
        max_memory=None,
    ):
        """``m`` [*, S, R, c_m], ``z`` [*, R, R, c_z], masks [*, S, R] / [*, R, R] (default all ones)
        -> ``(m, z, s)`` with ``s`` [*, R, c_s]. ``dap``: a :class:`fastfold.parallel.Dap` (inputs
        and outputs whole on every rank); ``checkpoint``: recompute each block in backward.
        ``max_memory``: bytes of activation memory allowed (per rank); the largest chunk size that
        fits is chosen (:func:`fastfold.autochunk.choose_chunk_size`; instead of ``chunk_size``)."""
        if max_memory is not None:
            chunk_size = self._auto_chunk(m, msa_mask, pair_mask, chunk_size, inplace, max_memory)
        m, z, _ = run_trunk(self.blocks, m, z, msa_mask, pair_mask, self.config, chunk_size, inplace, dap, checkpoint)
        first = m[..., 0, :, :]  # [*, R, c_m]
        if dap is None:
            return m, z, self.linear(first)
        n_res = first.shape[-2]
        first = pad_axis(first, -2, dap.padded(n_res))
        s = dap.gather_output(self.linear(dap.scatter(first, -2)), -2)  # partitioned, see [Note: DAP layouts]
        return m, z, s[..., :n_res, :]
