"""Sequence parallelism: each rank of a group of ``P`` holds ``T/P`` consecutive tokens of every
sequence, weights are replicated, and only attention communicates.

* **Ring self-attention** (Li et al., 2021): the key chunks travel around the ring to build this
  rank's rows of ``QK^T`` (``(B, h, T/P, T)``), the softmax is local, then the value chunks travel
  around the ring to form ``softmax(QK^T) V``. Each hop is a differentiable ring shift whose
  backward shifts the gradient the other way, so autograd derives the paper's backward.
* **All-to-all attention** (DeepSpeed-Ulysses): one all-to-all turns ``(B, h, T/P, d)``
  sequence-split q/k/v into ``(B, h/P, T, d)`` head-split ones, plain attention runs, and one
  all-to-all switches back.

Both are exact (causal masks use global positions). Weight gradients are partial sums over the
sequence group: :func:`all_reduce_gradients` sums them (over a ``dp x sp`` product group when used
with data parallel). Formulas: see the docs page, section "Sequence parallel".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm import all_reduce, all_to_all_along_dims, gather_along_dim, ring_exchange, split_along_dim
from colossal.tensor_parallel.plan import Style, convert_model, gpt_plan
from colossal.tensor_parallel.validation import check_divisible

__all__ = [
    "ring_attention",
    "all_to_all_attention",
    "SequenceParallelAttention",
    "check_convertible",
    "SequencePositionEmbedding",
    "split_sequence",
    "gather_sequence",
    "all_reduce_gradients",
    "apply_sequence",
]


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return ring_exchange(x, group, shift=1, tag="tp.sequence.ring")

    @staticmethod
    def backward(ctx, grad):
        return ring_exchange(grad, ctx.group, shift=-1, tag="tp.sequence.ring.bwd"), None


def _ring_chunks(x: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``x`` indexed by group rank, by ``P-1`` ring shifts (differentiable)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    chunks: list[torch.Tensor | None] = [None] * p
    cur = x
    for step in range(p):
        chunks[(r - step) % p] = cur  # after `step` shifts we hold rank r-step's chunk
        if step < p - 1:
            cur = _RingShift.apply(cur, group)
    return chunks


def _mask_scores(scores: torch.Tensor, rows0: int, causal: bool, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Mask ``scores (B, h, t, T)`` whose rows are global query positions ``rows0 + i``: causal
    (a key after the query) and key padding (``key_mask (B, T)``, ``False`` = padding). Masked
    scores get the dtype's lowest value, as Hugging Face's eager attention does, so that a row
    with nothing to attend gives a uniform average rather than NaN."""
    low = torch.finfo(scores.dtype).min
    if causal:
        rows = torch.arange(scores.shape[-2], device=scores.device).unsqueeze(1) + rows0
        cols = torch.arange(scores.shape[-1], device=scores.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, low)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], low)
    return scores


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    causal: bool = True,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Exact attention of sequence-split ``q, k, v`` ``(B, h, T/P, d)`` (rank ``r`` holds tokens
    ``[r*T/P, (r+1)*T/P)``) by ring ``QK^T`` and ring ``AV``; returns ``(B, h, T/P, d)``.

    ``causal``: a query attends to keys at or before its global position; ``key_mask (B, T)``
    (the whole sequence, ``False`` = padding) hides keys; ``scale`` defaults to ``1/sqrt(d)``;
    ``dropout_p`` drops attention probabilities (training)."""
    p, r, t = dist.get_world_size(group), dist.get_rank(group), q.shape[-2]
    with torch.profiler.record_function("colossal.tensor_parallel::ring_qk"):
        scores = torch.cat([q @ kc.transpose(-1, -2) for kc in _ring_chunks(k, group)], dim=-1)  # (B,h,t,T)
        scores = scores * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    probs = _mask_scores(scores, r * t, causal, key_mask).softmax(dim=-1)  # (B, h, t, T)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    with torch.profiler.record_function("colossal.tensor_parallel::ring_av"):
        vs = _ring_chunks(v, group)
        return sum(probs[..., j * t : (j + 1) * t] @ vs[j] for j in range(p))


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    causal: bool = True,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Exact attention of sequence-split ``q, k, v`` ``(B, h, T/P, d)`` through a switch to
    head-split ``(B, h/P, T, d)`` and back (``h`` must be divisible by ``P``); ``causal``,
    ``scale``, ``key_mask (B, T)`` and ``dropout_p`` as in :func:`ring_attention`."""
    check_divisible(q.shape[1], dist.get_world_size(group), "heads", "the sequence group size")
    with torch.profiler.record_function("colossal.tensor_parallel::all_to_all_attention"):
        qh, kh, vh = (all_to_all_along_dims(x, 1, 2, group) for x in (q, k, v))  # (B, h/P, T, d)
        if key_mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout_p, is_causal=causal, scale=scale)
        else:
            b, _, n, _ = qh.shape
            bias = _mask_scores(qh.new_zeros(b, 1, n, n), 0, causal, key_mask)  # (B, 1, T, T) additive
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, dropout_p=dropout_p, scale=scale)
        return all_to_all_along_dims(out, 2, 1, group)  # (B, h, T/P, d)


class SequenceParallelAttention(nn.Module):
    """A self-attention block (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``n_head``,
    ``is_causal``, optional ``resid_drop``) on a sequence-split input ``(B, T/P, C)``: causal or
    bidirectional as the module's ``is_causal`` says."""

    NEEDS = ("q_proj", "k_proj", "v_proj", "out_proj", "n_head", "is_causal")
    """The attributes a dense attention module must have to be converted."""

    def __init__(self, attn: nn.Module, group: ProcessGroup, kind: str = "ring"):
        super().__init__()
        if kind not in ("ring", "all_to_all"):
            raise ValueError(f"kind must be 'ring' or 'all_to_all', got {kind!r}")
        check_convertible(attn)
        if kind == "all_to_all":
            check_divisible(attn.n_head, dist.get_world_size(group), "n_head", "the sequence group size")
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
        self.resid_drop = getattr(attn, "resid_drop", nn.Identity())
        self.n_head, self.group, self.kind, self.is_causal = attn.n_head, group, kind, attn.is_causal

    @classmethod
    def from_dense(cls, attn: nn.Module, group: ProcessGroup, kind: str = "ring") -> SequenceParallelAttention:
        """Wrap ``attn``'s projections (shared, not copied: weights stay replicated)."""
        return cls(attn, group, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T/P, C)`` -> ``(B, T/P, C)``."""
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, self.n_head, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        attend = ring_attention if self.kind == "ring" else all_to_all_attention
        y = attend(q, k, v, self.group, causal=self.is_causal).transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.out_proj(y))


def check_convertible(attn: nn.Module) -> None:
    """Raise ``TypeError`` naming what ``attn`` lacks to become a :class:`SequenceParallelAttention`
    (its semantics, causal or not, must be stated by ``is_causal``, never guessed)."""
    missing = [
        a for a in ("q_proj", "k_proj", "v_proj", "out_proj") if not isinstance(getattr(attn, a, None), nn.Module)
    ]
    missing += [] if isinstance(getattr(attn, "n_head", None), int) else ["n_head (int)"]
    missing += [] if isinstance(getattr(attn, "is_causal", None), bool) else ["is_causal (bool)"]
    if missing:
        raise TypeError(
            f"{type(attn).__name__} cannot become sequence-parallel attention: it lacks {missing}; a converted "
            f"module needs q_proj, k_proj, v_proj, out_proj (modules), n_head (int) and is_causal (bool), and "
            f"its forward must be attention(x) -> out_proj(softmax(q k^T / sqrt(d) [+ causal mask]) v)"
        )


class SequencePositionEmbedding(nn.Module):
    """A position embedding for sequence-split inputs: position ``i`` of this rank's chunk is
    global position ``rank * T/P + i`` (the weight is shared with the dense embedding)."""

    def __init__(self, emb: nn.Embedding, group: ProcessGroup):
        super().__init__()
        self.weight, self.group = emb.weight, group

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: ProcessGroup) -> SequencePositionEmbedding:
        """Share ``emb``'s weight."""
        return cls(emb, group)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        """``pos`` local positions ``(t,)`` -> ``(t, C)`` embeddings of the global positions."""
        offset = dist.get_rank(self.group) * pos.shape[-1]
        if offset + pos.shape[-1] > self.weight.shape[0]:
            raise ValueError(
                f"sequence length {pos.shape[-1] * dist.get_world_size(self.group)} exceeds the "
                f"{self.weight.shape[0]} positions of the embedding"
            )
        return F.embedding(pos + offset, self.weight)


def split_sequence(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of a replicated ``x`` along the sequence ``dim`` (backward all-gathers)."""
    check_divisible(x.shape[dim], dist.get_world_size(group), "sequence length", "the sequence group size")
    return split_along_dim(x, dim, group)


def gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All-gather sequence chunks along ``dim`` (backward keeps this rank's chunk)."""
    return gather_along_dim(x, dim, group)


def all_reduce_gradients(model: nn.Module, group: ProcessGroup, average: bool = True) -> None:
    """Sum (``average``: mean) every parameter gradient over ``group`` (the sequence group, or a
    data x sequence product group), one all-reduce per parameter."""
    n = dist.get_world_size(group)
    with torch.profiler.record_function("colossal.tensor_parallel::sequence_grad_sync"):
        for p in model.parameters():
            if p.grad is not None:
                all_reduce(p.grad, group=group, tag="tp.sequence.grad")
                if average:
                    p.grad.div_(n)


def apply_sequence(model: nn.Module, group: ProcessGroup, plan: dict | None = None, kind: str = "ring") -> nn.Module:
    """Convert ``model`` in place: ``ATTENTION`` modules become :class:`SequenceParallelAttention`
    (``kind`` ``"ring"`` or ``"all_to_all"``), ``POS_EMBED`` a :class:`SequencePositionEmbedding`."""
    factories = {
        Style.ATTENTION: lambda m: SequenceParallelAttention.from_dense(m, group, kind),
        Style.POS_EMBED: lambda m: SequencePositionEmbedding.from_dense(m, group),
    }
    with torch.profiler.record_function("colossal.tensor_parallel::apply_sequence"):
        return convert_model(model, plan or gpt_plan("sequence"), factories, 1, "sequence")
