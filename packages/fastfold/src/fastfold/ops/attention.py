"""The attention core ``softmax(q k^T + sum(biases)) v`` of every Evoformer attention.

[Note: fused attention in inference]
Without autograd the core runs as ``torch.nn.functional.scaled_dot_product_attention`` (on CPU a
blocked "flash" kernel, on CUDA flash/memory-efficient kernels) with the biases as one additive
mask, so the ``[*, H, Q, K]`` logits and probabilities never exist whole. Two facts keep the mask
small: a bias that is constant along the queries (the key-mask bias ``inf * (mask - 1)``, shape
``[*, 1, 1, K]``) is dropped when it is all zero (no masked keys, the common case: the check reads
``K`` values per batch row, not the logits), and a lone bias is passed as it is, broadcast (the
pair bias ``[1, H, Q, K]`` serves every sequence of the chunk without a copy). Only when keys are
masked *and* a pair bias exists are the two summed into one mask of the chunk's logits size, which
is still one buffer fewer than the eager path (logits + probabilities). The kernel reassociates the
softmax sums, so results differ from the eager path by float rounding (~1e-6 relative in float32).
With autograd (training) the forward is the same kernel call (``_FusedAttention``), so a forward
with and one without autograd agree bit for bit (which [Note: checkpointing with the inference
forward] relies on); only ``q, k, v`` and the biases are saved, and backward recomputes the
probabilities ``P = softmax(q k^T + sum(biases))`` eagerly (one chunk's logits at a time) and
differentiates the eager formula: ``dv = P^T g``, ``dS = P * (g v^T - rowsum(P * g v^T))``,
``dq = dS k``, ``dk = dS^T q``, each bias's gradient ``dS`` summed over the axes it broadcasts along
(the pair bias over the sequences). Inputs that are not 4-D (extra batch axes) or not floating point
take the eager path: logits from ``q @ k^T``, biases added in place, softmax, ``@ v``.

[Note: eager attention in training]
Where the logits of one call are small (at most ``EAGER_TRAINING_MAX_BYTES``: n_res 64-128 training
crops, the MSA attentions of most), a training forward runs the eager path under autograd instead
of ``_FusedAttention``: autograd keeps the probabilities (one logits-sized buffer per attention of
the block being recomputed, as OpenFold's), so backward does not recompute them, and on CPU the
eager bmm/softmax use every thread where the flash kernel gains little from a second one at these
sizes (n_res 64, 2 threads: triangle attention forward + backward 1.3x faster). The checkpointed
forward runs without autograd but inside :func:`training_kernels`, which makes this same choice,
so the two forwards still agree bit for bit. Inference outside :func:`training_kernels` keeps the
fused kernel at every size (its chunks never hold the probabilities whole).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from fastfold.ops.softmax import check_broadcast

__all__ = ["attention_core", "training_kernels", "EAGER_TRAINING_MAX_BYTES"]

EAGER_TRAINING_MAX_BYTES = 64 * 2**20
"""Largest logits buffer (bytes, one ``attention_core`` call) for which training runs the eager
path (see [Note: eager attention in training])."""

_state = threading.local()


@contextlib.contextmanager
def training_kernels() -> Iterator[None]:
    """Within: ``attention_core`` picks the kernels of a training forward even without autograd,
    so a checkpointed block's no-grad forward and its recompute agree bit for bit (see [Note: eager
    attention in training]). Per thread (a CUDA backward runs on autograd's device thread)."""
    previous = getattr(_state, "training", False)
    _state.training = True
    try:
        yield
    finally:
        _state.training = previous


def _nonzero(biases: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The biases less the all-zero key masks (no masked key) that need no gradient."""
    return [b for b in biases if b.requires_grad or not ((b.dim() < 2 or b.shape[-2] == 1) and not bool(b.any()))]


def _merged_mask(biases: Sequence[torch.Tensor]) -> torch.Tensor | None:
    kept = _nonzero(biases)
    if not kept:
        return None
    mask = kept[0]
    for b in kept[1:]:
        mask = mask + b  # [Note: fused attention in inference]: only with masked keys and a pair bias
    return mask if mask.dim() >= 2 else mask.view(1, -1)  # the kernel wants a [..., Q, K] mask


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: Sequence[torch.Tensor]) -> torch.Tensor:
    mask = _merged_mask(biases)
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


class _FusedAttention(torch.autograd.Function):
    """The fused forward with the eager formula's gradients (see [Note: fused attention in inference])."""

    @staticmethod
    def forward(ctx, q, k, v, *biases):
        ctx.save_for_backward(q, k, v, *biases)
        # detached: the kernel choice looks at requires_grad (a mask that requires grad sends the
        # call to the math path), and this call must be the one the no-grad forward makes
        return _fused(q.detach(), k.detach(), v.detach(), [b.detach() for b in biases])

    @staticmethod
    def backward(ctx, g):
        q, k, v, *biases = ctx.saved_tensors
        need_q, need_k, need_v, *need_b = ctx.needs_input_grad
        p = q @ k.transpose(-1, -2)  # [*, H, Q, K]
        for b in biases:
            p.add_(b)
        p = torch.softmax(p, dim=-1)
        dv = p.transpose(-1, -2) @ g if need_v else None
        ds = torch._softmax_backward_data(g @ v.transpose(-1, -2), p, -1, p.dtype)
        del p
        dq = ds @ k if need_q else None
        dk = ds.transpose(-1, -2) @ q if need_k else None
        db = [ds.sum_to_size(b.shape).to(b.dtype) if need else None for b, need in zip(biases, need_b)]
        return dq, dk, dv, *db


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """``softmax(q @ k^T + sum(biases)) @ v`` for ``q`` [*, H, Q, d] (already scaled), ``k``/``v``
    [*, H, K, d] and biases broadcasting to [*, H, Q, K]; returns [*, H, Q, d]."""
    logits_shape = (*q.shape[:-1], k.shape[-2])
    for i, b in enumerate(biases):
        check_broadcast(b.shape, logits_shape, f"biases[{i}]")
    training = torch.is_grad_enabled() or getattr(_state, "training", False)
    small = q.element_size() * q.shape[:-1].numel() * k.shape[-2] <= EAGER_TRAINING_MAX_BYTES
    if q.dim() != 4 or not q.is_floating_point() or (training and small):  # [Note: eager attention in training]
        logits = q @ k.transpose(-1, -2)  # [*, H, Q, K]; a fresh product, so the biases go in in place
        for b in _nonzero(biases):
            logits.add_(b)
        return torch.softmax(logits, dim=-1) @ v
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *biases)):
        return _FusedAttention.apply(q, k, v, *biases)
    return _fused(q, k, v, biases)
