"""Sequence parallelism: each rank of a group of ``P`` holds ``T/P`` consecutive tokens of every
sequence, weights are replicated, and only attention communicates.

* **Ring self-attention** (Li et al., 2021): the key and value chunks travel around the ring, and
  this rank's queries attend to each chunk as it arrives. The softmax is computed online, block
  by block (running row maximum and sum, as in memory-efficient and ring attention: Rabe & Staats
  2021, Liu et al. 2023), so no ``(B, h, T/P, T)`` score matrix is ever kept: saved for backward
  are q, the gathered k and v, the output and the row log-sum-exp, all linear in ``T``. The
  backward recomputes each block's probabilities from the log-sum-exp and sends the key and value
  gradients back around the ring to their owners. With dropout on the probabilities the paper's
  form runs instead (the whole ``(B, h, T/P, T)`` rows, softmax, dropout, autograd backward).
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


def _mask_scores(
    scores: torch.Tensor,
    rows0: int,
    causal: bool,
    key_mask: torch.Tensor | None,
    cols0: int = 0,
    inplace: bool = False,
) -> torch.Tensor:
    """Mask ``scores (B, h, t, n)`` whose rows are global query positions ``rows0 + i`` and columns
    global key positions ``cols0 + j``: causal (a key after the query) and key padding
    (``key_mask (B, T)`` over the whole sequence, ``False`` = padding). Masked scores get the
    dtype's lowest value, as Hugging Face's eager attention does, so that a row with nothing to
    attend gives a uniform average rather than NaN. ``inplace`` masks ``scores`` itself."""
    fill = torch.Tensor.masked_fill_ if inplace else torch.Tensor.masked_fill
    low = torch.finfo(scores.dtype).min
    if causal:
        rows = torch.arange(scores.shape[-2], device=scores.device).unsqueeze(1) + rows0
        cols = torch.arange(scores.shape[-1], device=scores.device).unsqueeze(0) + cols0
        scores = fill(scores, cols > rows, low)
    if key_mask is not None:
        scores = fill(scores, ~key_mask.bool()[:, None, None, cols0 : cols0 + scores.shape[-1]], low)
    return scores


RING_BLOCK = 512
"""Keys per block of the online softmax in :func:`ring_attention`: a block's scores are
``(B, h, T/P, RING_BLOCK)``, transient (freed before the next block)."""


def _block_scores(q, kb, scale, rows0, cols0, causal, key_mask):
    """Scaled scores ``(B, h, t, n)`` of queries at global rows ``rows0 + i`` against the key block
    at global columns ``cols0 + j``, masked by :func:`_mask_scores` in place."""
    return _mask_scores((q @ kb.transpose(-1, -2)).mul_(scale), rows0, causal, key_mask, cols0, inplace=True)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _key_blocks(p: int, r: int, t: int, causal: bool):
    """``(chunk j, start, stop)`` of the key blocks rank ``r``'s queries see (causal: no chunk
    after its own), ``RING_BLOCK`` keys at most each."""
    for j in range(p):
        if causal and j > r:
            continue
        for a in range(0, t, RING_BLOCK):
            yield j, a, min(a + RING_BLOCK, t)


class _RingAttention(torch.autograd.Function):
    """Exact ring attention with an online softmax (see the module docstring). Forward: ``P-1``
    ring steps of the packed ``[k, v]`` chunk; backward: ``P-1`` ring steps of the packed
    ``[dk, dv]`` partial sums, which arrive at their owner complete."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, key_mask):
        p, r, t = dist.get_world_size(group), dist.get_rank(group), q.shape[-2]
        d = k.shape[-1]
        with torch.no_grad():
            # one ring step carries both k and v; (B, h, T, 2d) by global position
            kv_all = torch.cat(_ring_chunks(torch.cat([k, v], dim=-1), group), dim=-2)
            ct = _compute_dtype(q)  # half inputs keep their softmax statistics in float32
            qc = q.to(ct)
            row_max = qc.new_full((*q.shape[:-1], 1), float("-inf"))
            row_sum = qc.new_zeros((*q.shape[:-1], 1))
            acc = torch.zeros_like(qc)
            for j, a, b in _key_blocks(p, r, t, causal):
                blk = kv_all[..., j * t + a : j * t + b, :].to(ct)
                s = _block_scores(qc, blk[..., :d], scale, r * t, j * t + a, causal, key_mask)
                new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
                s.sub_(new_max).exp_()  # s is now the block's unnormalised probabilities
                rescale = (row_max - new_max).exp_()
                row_sum.mul_(rescale).add_(s.sum(dim=-1, keepdim=True))
                acc.mul_(rescale).add_(s @ blk[..., d:])
                row_max = new_max
            if causal and r < p - 1:  # a row with no key to attend averages all T values, as the dense
                empty = row_max == torch.finfo(ct).min  # form's lowest-value mask does (future keys too)
                if empty.any():
                    acc = torch.where(empty, kv_all[..., d:].to(ct).sum(dim=-2, keepdim=True), acc)
                    row_sum = torch.where(empty, float(kv_all.shape[-2]), row_sum)
            out = acc.div_(row_sum).to(q.dtype)
        # the row statistics (B, h, t, 1) (float32 for half inputs), not a log-sum-exp: a row with
        # nothing to attend has max = the dtype's lowest value, where max + log(sum) rounds to max
        ctx.save_for_backward(q, kv_all, out, row_max, row_sum, key_mask if key_mask is not None else q.new_empty(0))
        ctx.group, ctx.causal, ctx.scale, ctx.has_mask = group, causal, scale, key_mask is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv_all, out, row_max, row_sum, key_mask = ctx.saved_tensors
        key_mask = key_mask if ctx.has_mask else None
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        p, r, t, d = dist.get_world_size(group), dist.get_rank(group), q.shape[-2], q.shape[-1]
        ct = _compute_dtype(q)
        qc, grad_out = q.to(ct), grad_out.to(ct)
        delta = (grad_out * out.to(ct)).sum(dim=-1, keepdim=True)  # (B, h, t, 1)
        dq = torch.zeros_like(qc)
        dkv = torch.zeros_like(kv_all, dtype=ct)  # this rank's contributions to every chunk's [dk, dv]
        empty = row_max == torch.finfo(ct).min  # rows with nothing to attend: every score masked, so
        empty = empty if empty.any() else None  # no score gradient (dq, dk), only the values' average
        for j, a, b in _key_blocks(p, r, t, causal):
            blk = kv_all[..., j * t + a : j * t + b, :].to(ct)
            probs = _block_scores(qc, blk[..., :d], scale, r * t, j * t + a, causal, key_mask)
            probs = probs.sub_(row_max).exp_().div_(row_sum)
            dkv[..., j * t + a : j * t + b, d:] += probs.transpose(-1, -2) @ grad_out
            ds = (grad_out @ blk[..., d:].transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
            if empty is not None:
                ds.masked_fill_(empty, 0.0)
            dq += ds @ blk[..., :d]
            dkv[..., j * t + a : j * t + b, :d] += ds.transpose(-1, -2) @ qc
        if causal and r < p - 1 and empty is not None:  # those rows averaged the later chunks' values too
            dkv[..., (r + 1) * t :, d:] += (grad_out * empty / row_sum).sum(dim=-2, keepdim=True)
        parts = dkv.to(kv_all.dtype).split(t, dim=-2)
        acc = parts[(r - 1) % p].contiguous()  # ring reduce: after P-1 steps we hold our own chunk's sum
        for step in range(1, p):
            acc = ring_exchange(acc, group, shift=1, tag="tp.sequence.ring.bwd") + parts[(r - 1 - step) % p]
        return dq.to(q.dtype), acc[..., :d], acc[..., d:], None, None, None, None


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
    if dropout_p == 0.0:
        with torch.profiler.record_function("colossal.tensor_parallel::ring_attention"):
            mask = None if key_mask is None else key_mask.bool()
            return _RingAttention.apply(
                q, k, v, group, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, mask
            )
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
