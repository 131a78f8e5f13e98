"""Vocab-parallel cross-entropy: the loss of logits split along the vocabulary, without gathering
them (Megatron-LM). Shared by every mode; each mode's ``cross_entropy_*`` picks the groups.

Per row it needs the global max (one all-reduce ``max`` of ``N`` floats) and, in one all-reduce
``sum`` of ``2N`` floats, the global sum of exponentials and the target's logit (held by exactly
one rank). The backward is local: ``softmax - onehot`` on this rank's vocabulary slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from colossal.comm import all_reduce, reduce_from_group

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        # logits: (..., V_local) float; target: (...) long, global vocabulary ids
        logits = logits.float()
        vmax = logits.detach().amax(dim=-1)  # (...)
        all_reduce(vmax, op="max", group=group, tag="tp.cross_entropy.max")
        shifted = logits - vmax.unsqueeze(-1)
        exp = shifted.exp()
        local = target - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        both = torch.stack([exp.sum(-1), picked])  # (2, ...)
        all_reduce(both, group=group, tag="tp.cross_entropy.sum")
        sumexp, picked = both[0], both[1]
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), local, inside)
        return sumexp.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_group: ProcessGroup,
    vocab_start: int,
    row_groups: Sequence[ProcessGroup] = (),
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., V_local)``, this rank's vocabulary slice starting at
    ``vocab_start``; the slices of ``vocab_group`` make up the vocabulary) against ``target``
    (``(...)``, the matching rows, global ids).

    ``reduction="none"``: per-row losses (equal on every rank of ``vocab_group``).
    ``"mean"``/``"sum"``: over *all* rows, also those of the ranks in ``row_groups`` (the groups the
    rows are split over); the result is the dense loss on every rank, and backward through it on
    every rank gives each rank exactly its share of the gradient.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on the rows")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    with torch.profiler.record_function("colossal.tensor_parallel::cross_entropy"):
        loss = _VocabParallelCE.apply(logits, target, vocab_start, vocab_group)
        if reduction == "none":
            return loss
        total, rows = loss.sum(), loss.numel()
        for g in row_groups:
            total = reduce_from_group(total, g)
            rows *= torch.distributed.get_world_size(g)
        return total / rows if reduction == "mean" else total
