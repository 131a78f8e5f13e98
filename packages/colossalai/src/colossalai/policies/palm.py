"""The hybrid plugin's policy for the ``colossalai`` PaLM (:mod:`colossalai.models.palm`)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

__all__ = ["PaLMPolicy"]


class PaLMPolicy:
    """PaLM: parallel blocks, multi-query attention, RoPE, SwiGLU, tied embeddings.

    * **Tensor parallel (1D)**: ``wte`` vocab-parallel and tied to the vocab-parallel ``lm_head``
      (logits split along the vocabulary, gathered for the criterion); ``q_proj``, ``fc_gate``,
      ``fc_in`` column-, ``out_proj``, ``fc_out`` row-parallel; the single key/value head
      (``k_proj``, ``v_proj``) is replicated, and since each rank's query heads use it, the
      gradient of its output is all-reduced over tp (Megatron's treatment of multi-query
      attention). ``n_head``, ``ffn_hidden`` and ``vocab_size`` must be divisible by ``tp_size``.
    * **Sequence parallel**: each attention runs ring / all-to-all causal attention on its chunk
      with RoPE at global positions (no position embedding to shift).
    * **Pipeline parallel**: as the GPT (``wte``, ``blocks``, ``ln_f``, ``lm_head``).
    """

    permutes = False
    """The 1D layout is one contiguous split per parameter."""

    def check(self, model: nn.Module, tp_size: int, sp_size: int, tp_mode: str, sp_kind: str, pp_size: int) -> None:
        """Divisibility of heads, MLP width and vocabulary by ``tp_size``; 1D only."""
        if tp_size > 1 and tp_mode != "1d":
            raise NotImplementedError(f"PaLM: tp_mode {tp_mode!r}; supported: '1d' (multi-query attention)")
        cfg = model.config
        for value, what in ((cfg.n_head, "n_head"), (cfg.ffn_hidden, "ffn_hidden"), (cfg.vocab_size, "vocab_size")):
            if value % tp_size:
                raise ValueError(f"PaLM: {what}={value} must be divisible by tp_size={tp_size}")
        if sp_size > 1 and sp_kind == "all_to_all" and (cfg.n_head // tp_size) % sp_size:
            raise ValueError(
                f"PaLM: all_to_all needs n_head / tp_size = {cfg.n_head // tp_size} divisible by {sp_size}"
            )

    def plan(self, model: nn.Module) -> dict:
        """The ``Style`` plan (1D)."""
        from colossal.tensor_parallel import Style

        return {
            "wte": Style.VOCAB_EMBED,
            "blocks.*.ln": Style.NORM,
            "blocks.*.attn.q_proj": Style.COL,
            "blocks.*.attn.out_proj": Style.ROW,
            "blocks.*.mlp.fc_gate": Style.COL,
            "blocks.*.mlp.fc_in": Style.COL,
            "blocks.*.mlp.fc_out": Style.ROW,
            "ln_f": Style.NORM,
            "lm_head": Style.LM_HEAD,
        }

    def convert_tp(self, model: nn.Module, group, mode: str) -> None:
        """The replicated key/value projections: all-reduce their output gradient over ``group``."""
        from colossal.comm import copy_to_group

        if dist.get_world_size(group) == 1:
            return
        for block in model.blocks:
            for proj in (block.attn.k_proj, block.attn.v_proj):
                proj.register_forward_hook(lambda mod, args, out: copy_to_group(out, group))

    def apply_sequence(self, model: nn.Module, inner: nn.Module, group, kind: str) -> nn.Module:
        """Sequence-parallel attention in every block; the ids are split and the logits gathered
        by ``SequenceParallel``."""
        from colossalai.booster.hybrid.wrappers import SequenceParallel

        for block in model.blocks:
            block.attn.sequence = (group, kind)
        return SequenceParallel(inner, group, dist.get_world_size(group))
