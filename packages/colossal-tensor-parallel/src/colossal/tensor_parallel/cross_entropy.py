"""Vocab-parallel cross-entropy: the loss of logits split along the vocabulary, without gathering
them (Megatron-LM). Shared by every mode; each mode's ``cross_entropy_*`` picks the groups.

Per row it needs the global max (one all-reduce ``max`` of ``N`` floats) and, in one all-reduce
``sum`` of ``2N`` floats (``3N`` with label smoothing, which also needs the sum of the logits),
the global sum of exponentials and the target's logit (held by exactly one rank). The backward is
local: ``softmax - (1 - eps) * onehot - eps / V`` on this rank's vocabulary slice.

It follows ``torch.nn.functional.cross_entropy``: rows whose target is ``ignore_index`` (default
-100, the padding label of PyTorch and Hugging Face) contribute no loss and no gradient and are
not counted by ``reduction="mean"``; any other target outside ``[0, V)`` raises ``ValueError``
before the first collective (every rank of the vocabulary group holds the same targets, so they
all raise).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.comm import all_reduce, reduce_from_group

__all__ = ["vocab_parallel_cross_entropy", "check_targets"]


def check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """Raise ``ValueError`` (``TypeError`` for a non-integer tensor) unless every entry of ``target``
    is ``ignore_index`` or a class in ``[0, vocab_size)``. Reads the targets on the host."""
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got dtype {target.dtype}")
    valid = target[target != ignore_index]
    if valid.numel() == 0:
        return
    lo, hi = int(valid.min()), int(valid.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"target holds class {lo if lo < 0 else hi}, outside [0, {vocab_size}) "
            f"(and not ignore_index={ignore_index})"
        )


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, ignore_index, smoothing):
        # logits: (..., V_local) float; target: (...) long, global vocabulary ids
        logits = logits.float()
        v_local = logits.shape[-1]
        vocab = v_local * dist.get_world_size(group)  # the slices are equal (every mode splits evenly)
        vmax = logits.detach().amax(dim=-1)  # (...)
        all_reduce(vmax, op="max", group=group, tag="tp.cross_entropy.max")
        shifted = logits - vmax.unsqueeze(-1)
        exp = shifted.exp()
        keep = target != ignore_index  # (...)
        local = target - vocab_start
        inside = (local >= 0) & (local < v_local) & keep
        local = local.clamp(0, v_local - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        parts = [exp.sum(-1), picked] + ([shifted.sum(-1)] if smoothing else [])
        both = torch.stack(parts)  # (2 or 3, ...)
        all_reduce(both, group=group, tag="tp.cross_entropy.sum")
        sumexp, picked = both[0], both[1]
        loss = sumexp.log() - (1.0 - smoothing) * picked
        if smoothing:
            loss = loss - smoothing / vocab * both[2]
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), local, inside, keep)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return loss * keep

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside, keep = ctx.saved_tensors
        g = softmax.clone()
        if ctx.smoothing:
            g.sub_(ctx.smoothing / ctx.vocab)
        g.scatter_add_(-1, local.unsqueeze(-1), -(1.0 - ctx.smoothing) * inside.to(g.dtype).unsqueeze(-1))
        return g * (grad * keep).unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_group: ProcessGroup,
    vocab_start: int,
    row_groups: Sequence[ProcessGroup] = (),
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., V_local)``, this rank's vocabulary slice starting at
    ``vocab_start``; the equal slices of ``vocab_group`` make up the vocabulary) against ``target``
    (``(...)``, the matching rows, global ids), as ``torch.nn.functional.cross_entropy``.

    ``reduction="none"``: per-row losses (equal on every rank of ``vocab_group``; 0 where the
    target is ``ignore_index``). ``"mean"``/``"sum"``: over *all* rows, also those of the ranks in
    ``row_groups`` (the groups the rows are split over); ``"mean"`` divides by the number of rows
    not ignored (NaN when there is none, as torch). The result is the dense loss on every rank,
    and backward through it on every rank gives each rank exactly its share of the gradient.
    ``label_smoothing`` mixes the target with the uniform distribution over the vocabulary.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on the rows")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    check_targets(target, logits.shape[-1] * dist.get_world_size(vocab_group), ignore_index)
    with torch.profiler.record_function("colossal.tensor_parallel::cross_entropy"):
        loss = _VocabParallelCE.apply(logits, target, vocab_start, vocab_group, ignore_index, float(label_smoothing))
        if reduction == "none":
            return loss
        total = loss.sum()
        if reduction == "sum":
            for g in row_groups:
                total = reduce_from_group(total, g)
            return total
        rows = (target != ignore_index).sum().to(total.dtype)  # counted rows: the ignored ones are not
        both = torch.stack([total, rows])  # (2,) one all-reduce per row group for the sum and the count
        for g in row_groups:
            both = reduce_from_group(both, g)
        return both[0] / both[1]
