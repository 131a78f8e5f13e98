"""Hybrid layouts (``HybridParallelPlugin``): one rank's step of dp x tp x sp x pp x ep, derived
from the single-process trace.

The trace records, per operator, which block runs it, what 1D tensor parallelism splits and what it
all-reduces ([Note: what tensor parallelism splits] in :mod:`colossal.planner.trace`). From that:

* **Pipeline parallelism** cuts the blocks into ``pp * pp_virtual`` equal chunks (``partition=
  "uniform"``, ``colossal.pipeline.partition_blocks``); chunk ``c`` runs on rank ``c % pp``
  (Megatron's interleaved placement), the embedding's parameters on the first chunk, the head's on
  the last, a tied embedding on both. A chunk's operators are the trace's from its first block's
  forward to the next chunk's, and from its last block's backward to the previous chunk's; its live
  bytes are the trace's less what earlier chunks saved (the boundary activation it receives is its own).
* **Micro-batches in flight** (``colossal.pipeline.schedules``): GPipe holds all ``m``; 1F1B and
  ZB-H1 ``min(pp - r, m)`` on rank ``r``; the interleaved schedule ``min(m v, 2 (pp - r - 1) +
  (v - 1) pp + 1)`` chunk-sized ones. Each beyond the running one holds the chunk's saved
  activations (its live bytes at the end of its forward).
* **Tensor parallelism** (1D): the split part of every live byte is divided by ``tp``; 2-D weights
  inside a block, the column layers' biases and the vocabulary-sized embedding and LM head are
  split, norms, row biases and position embeddings kept whole (``gpt_plan("1d")``); MoE layers are
  not converted (their experts are ep's). 2D and 3D partition every parameter ``tp`` ways, 2.5D
  ``q^2 = tp / depth`` ways (replicated over the depth); a block's activations are divided by
  ``tp`` in 3D and by the grid side ``q`` in 2D/2.5D (SUMMA gathers its operands along one side;
  measured on 2D: still 25% low).
* **Sequence parallelism** is traced at ``seq / sp`` tokens; the head and loss run on the logits
  gathered over ``sp`` (the user's criterion sees the whole sequence): the gathered logits and
  their log-softmax are added over the head's operators (under 1D tp, the gathered logits beside
  the split ones).
* **Expert parallelism** divides the experts' parameters (``*.experts.<i>.*``) by ``ep``.
* **Data parallelism** over ``dp x sp`` ranks is DDP (``zero_stage=0``) or ZeRO 1/2 on the rank's
  own parameters: the engines' rules of :mod:`colossal.planner.memory`, applied to the derived
  step. Parameters, gradients and optimizer states are fp32 (the plugin trains under autocast); a
  bf16/fp16 step also holds autocast's low-precision copy of every weight a matmul reads.

Step time: the rank's operators per micro-batch (split work divided by ``tp``) times
``m + bubble`` (``pp - 1`` for GPipe and 1F1B, ``(pp - 1) / v`` interleaved, ``(pp - 1) / 3`` for
ZB-H1), the slowest rank's, plus the tensor-parallel all-reduces (on the critical path), the
pipeline's point-to-point sends, ring or all-to-all attention's exchanges, the MoE all-to-alls,
the logits gathered for the criterion, and the data-parallel gradient reduction (after the
pipeline's flush; overlapped with backward on CUDA only without pp).
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from colossal.planner.layout import Layout
from colossal.planner.trace import ModelTrace, ParamInfo

__all__ = [
    "check_hybrid",
    "rank_step",
    "RankStep",
    "hybrid_comm_calls",
    "model_flops",
    "in_flight",
]

_EXPERT = re.compile(r"(?:^|\.)experts\.")  # an indexed expert's or a stacked experts' weight


def grid_side(layout: Layout) -> int:
    """The side ``q`` of the tensor-parallel grid (1D: ``tp``)."""
    if layout.tp_mode == "1d":
        return layout.tp
    if layout.tp_mode == "3d":
        return round(layout.tp ** (1 / 3))
    return math.isqrt(layout.tp // layout.tp_depth)


def check_hybrid(trace: ModelTrace, layout: Layout) -> None:
    """``ValueError`` naming the value when ``layout`` cannot divide the traced model: heads and
    widths by the tensor-parallel grid, blocks by ``pp * pp_virtual``, experts by ``ep``, the
    sequence by ``sp``."""
    if layout.engine != "hybrid":
        return
    tp, q = layout.tp, grid_side(layout)
    heads, hidden = trace.heads, trace.hidden
    if tp > 1:
        if heads and heads % q:
            raise ValueError(f"{layout.label}: {heads} attention heads are not divisible by tp grid side {q}")
        split = tp if layout.tp_mode in ("1d", "3d") else q * q
        if hidden and hidden % split:
            raise ValueError(f"{layout.label}: hidden size {hidden} is not divisible by {split} ({layout.tp_mode} tp)")
    n_blocks, chunks = len(trace.blocks), layout.pp * layout.pp_virtual
    if layout.pp > 1:
        if n_blocks < chunks or n_blocks % chunks:
            raise ValueError(
                f"{layout.label}: {n_blocks} blocks cannot be cut into pp * pp_virtual = {chunks} equal chunks"
            )
    if layout.ep > 1:
        if not trace.experts:
            raise ValueError(f"{layout.label}: ep={layout.ep}, but the model has no experts (*.experts.<i>.*)")
        if trace.experts % layout.ep:
            raise ValueError(f"{layout.label}: {trace.experts} experts are not divisible by ep={layout.ep}")
    if layout.sp > 1 and layout.sp_kind == "all_to_all" and heads and heads % (layout.sp * q):
        raise ValueError(f"{layout.label}: all-to-all attention needs heads ({heads}) divisible by sp x tp grid side")


def _chunks(trace: ModelTrace, layout: Layout) -> list[tuple[int, int]]:
    n, k = len(trace.blocks), layout.pp * layout.pp_virtual if layout.pp > 1 else 1
    if k == 1 or n == 0:
        return [(0, n)]
    size = n // k
    return [(i * size, (i + 1) * size) for i in range(k)]


def _spans(trace: ModelTrace, chunks: list[tuple[int, int]], k: int) -> tuple[range, range]:
    """Forward and backward operators of chunk ``k`` (one micro-batch)."""
    b, last = trace.blocks, len(chunks) - 1
    lo, hi = chunks[k]
    f0 = 0 if k == 0 else trace.unit_forward[b[lo]][0]
    f1 = trace.backward_start if k == last else trace.unit_forward[b[hi]][0]
    b0 = trace.backward_start if k == last else trace.unit_backward[b[hi - 1]]
    b1 = trace.ops if k == 0 else trace.unit_backward[b[lo - 1]]
    return range(f0, f1), range(b0, b1)


def in_flight(layout: Layout, rank: int) -> tuple[int, int]:
    """(chunk-sized micro-batches the schedule holds at once on pipeline rank ``rank``, chunks per rank)."""
    p, m, v = layout.pp, layout.microbatches, layout.pp_virtual
    if p == 1:
        return 1, 1
    if layout.pp_schedule == "gpipe":
        return m * v, v
    if layout.pp_schedule == "interleaved":
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1), v
    return min(p - rank, m), v


def _block_of(trace: ModelTrace) -> list[int]:
    """Per unit: the position in ``trace.blocks`` of the block enclosing it (-1: the root)."""
    out = []
    for name in trace.units:
        pos = -1
        for j, b in enumerate(trace.blocks):
            o = trace.units[b]
            if name == o or name.startswith(o + "."):
                pos = j
                break
        out.append(pos)
    return out


def _param_chunks(trace: ModelTrace, chunks: list[tuple[int, int]]) -> list[set[int]]:
    block_of, last = _block_of(trace), len(chunks) - 1
    first_block = trace.unit_forward[trace.blocks[0]][0] if trace.blocks else trace.backward_start
    out = []
    for p in trace.params:
        pos = block_of[p.unit]
        if pos >= 0:
            out.append({next(k for k, (lo, hi) in enumerate(chunks) if lo <= pos < hi)})
        elif p.tied:
            out.append({0, last})
        elif 0 <= p.first_use < first_block:
            out.append({0})
        else:
            out.append({last})
    return out


def _tp_divisor(trace: ModelTrace, layout: Layout, p: ParamInfo, in_block: bool, vocab: int) -> int:
    if layout.tp == 1:
        return 1
    if layout.tp_mode != "1d":
        return layout.tp // layout.tp_depth if layout.tp_mode == "2.5d" else layout.tp
    if in_block:
        return layout.tp if len(p.shape) >= 2 or p.split_use else 1
    return layout.tp if len(p.shape) == 2 and p.shape[0] == vocab else 1


@dataclasses.dataclass(frozen=True, slots=True)
class RankStep:
    """One pipeline rank's step of one micro-batch, as a trace the engines' rules apply to."""

    trace: ModelTrace
    """The derived trace: this rank's parameters (their per-rank sizes), its operators of one
    micro-batch (forward of its chunks, then their backward), live bytes per rank with the
    micro-batches in flight added."""
    rank: int
    """Pipeline rank."""
    in_flight_bytes: int
    """Saved activations of the other micro-batches in flight (part of ``trace.live``)."""
    compute_ops: tuple[int, ...]
    """The original trace's operators this rank runs per micro-batch."""
    autocast_bytes: int
    """Autocast's low-precision weight copies (bf16/fp16 steps)."""


def rank_step(trace: ModelTrace, layout: Layout, rank: int) -> RankStep:
    """Pipeline rank ``rank``'s derived step (see the module docstring)."""
    chunks = _chunks(trace, layout)
    mine = list(range(rank, len(chunks), layout.pp))
    tp = layout.tp
    part = trace.live_split if layout.tp_mode == "1d" else trace.live_block
    act_split = tp if layout.tp_mode in ("1d", "3d") else grid_side(layout)  # SUMMA gathers rows: q ways
    frac = (1 - 1 / act_split) if tp > 1 and part else 0.0
    boundary = trace.batch * trace.seq * trace.hidden * trace.dtype.itemsize
    b = trace.blocks
    # the head and loss: the plugins gather the logits for the user's criterion. Under sp the
    # gathered (b, T, V) logits and their log-softmax are sp times the traced ones; under 1D tp
    # the rank holds its split logits and the gathered pieces besides the whole logits
    logits = trace.batch * trace.seq * trace.vocab * trace.dtype.itemsize
    head_extra = 2 * (layout.sp - 1) * logits + (logits if tp > 1 and layout.tp_mode == "1d" else 0)
    head = range(trace.unit_forward[b[-1]][1] + 1, trace.unit_backward[b[-1]]) if (head_extra and b) else range(0)

    def value(j: int, base: int, base_part: int) -> int:
        v = trace.live[j] - base - frac * (part[j] - base_part) if part else trace.live[j] - base
        if j in head:
            v += head_extra
        return max(0, round(v))

    ops: list[int] = []
    vals: list[int] = []
    saved: list[int] = []
    spans = [(k, *_spans(trace, chunks, k)) for k in mine]
    bases = {}
    for k, f, _ in spans:
        if f.start == 0:
            bases[k] = (0, 0)
        else:
            prev_part = part[f.start - 1] if part else 0
            keep = boundary if layout.tp_mode == "1d" else 0  # the boundary is not split in 1D (whole hidden)
            bases[k] = (trace.live[f.start - 1] - boundary, max(0, prev_part - (boundary - keep)))
        for j in f:
            ops.append(j)
            vals.append(value(j, *bases[k]))
        saved.append(value(f.stop - 1, *bases[k]) if len(f) else 0)
    backward_start = len(ops)
    for k, _, bw in reversed(spans):
        for j in bw:
            ops.append(j)
            vals.append(value(j, *bases[k]))
    n_flight, v = in_flight(layout, rank)
    per_chunk = max(saved) if saved else 0
    extra = max(0, n_flight - 1) * per_chunk
    # parameters of this rank, at their per-rank sizes
    block_of = _block_of(trace)
    vocab = trace.vocab
    where = _param_chunks(trace, chunks)
    index = {j: n for n, j in enumerate(ops)}
    params, grad_op = [], []
    matmul_weights = 0
    for i, p in enumerate(trace.params):
        if not where[i] & set(mine):
            continue
        if _EXPERT.search(p.name):  # MoE layers are not tensor-parallel; ep shares out their experts
            numel = -(-p.numel // layout.ep)
        else:
            numel = -(-p.numel // _tp_divisor(trace, layout, p, block_of[p.unit] >= 0, vocab))
        params.append(dataclasses.replace(p, numel=numel, dtype=torch.float32, unit=0))
        g = trace.grad_op[i]
        grad_op.append(index.get(g, len(ops) - 1) if g >= 0 else -1)
        if len(p.shape) >= 2:
            matmul_weights += numel
    autocast = matmul_weights * trace.dtype.itemsize if trace.dtype != torch.float32 else 0
    live = tuple(x + extra + autocast for x in vals)
    derived = dataclasses.replace(
        trace,
        params=tuple(params),
        live=live,
        flops=tuple(trace.flops[j] for j in ops),
        io_bytes=tuple(trace.io_bytes[j] for j in ops),
        attention=tuple(trace.attention[j] for j in ops),
        backward_start=backward_start,
        grad_op=tuple(grad_op),
        units=("",),
        unit_forward=((0, backward_start),),
        unit_backward=(backward_start,),
        blocks=(),
        live_split=(),
        live_block=(),
        split=(),
        in_block=(),
        reduce_bytes=(),
    )
    return RankStep(derived, rank, extra, tuple(ops), autocast)


def hybrid_comm_calls(trace: ModelTrace, layout: Layout, step: RankStep) -> list[tuple[str, int, str]]:
    """The collectives pipeline rank ``step.rank`` issues per step besides the data-parallel
    gradient reduction, as ``(op, message bytes, group)`` with group ``"tp"``, ``"sp"``, ``"pp"``
    or ``"ep"``."""
    m = layout.microbatches
    out: list[tuple[str, int, str]] = []
    w = trace.dtype.itemsize
    act = trace.batch * trace.seq * trace.hidden * w
    ops = step.compute_ops
    if layout.tp > 1:
        if layout.tp_mode == "1d":
            for j in ops:
                if trace.reduce_bytes[j]:
                    out += [("all_reduce", trace.reduce_bytes[j], "tp")] * m
            if 0 in ops and trace.vocab:  # the vocabulary-parallel embedding's all-reduce
                out += [("all_reduce", act, "tp")] * m
        else:  # SUMMA-style: each weight matmul gathers its operands over one side of the grid
            q = grid_side(layout)
            for j in ops:
                if trace.in_block[j] and trace.flops[j] and not trace.attention[j]:
                    out += [("all_gather", trace.io_bytes[j] // layout.tp * q, "tp")] * m
        if trace.backward_start - 1 in ops and trace.vocab:  # GatherLogits: the split logits gathered
            out += [("all_gather", trace.batch * trace.seq * trace.vocab * w, "tp")] * m
    if layout.pp > 1:
        chunks = _chunks(trace, layout)
        mine = [k for k in range(step.rank, len(chunks), layout.pp)]
        sends = sum((k < len(chunks) - 1) + (k > 0) for k in mine)  # activation forward, gradient backward
        out += [("send", act // (layout.tp if layout.tp_mode != "1d" else 1), "pp")] * (sends * m)
    if layout.sp > 1:
        if trace.backward_start - 1 in ops and trace.vocab:  # the logits gathered over sp for the criterion
            out += [("all_gather", layout.sp * trace.batch * trace.seq * trace.vocab * w, "sp")] * m
        n_blocks = _blocks_on_rank(trace, layout, step.rank)
        per_block = (
            [("send", 2 * act, "sp")] * (3 * (layout.sp - 1))  # k, v around the ring; twice in backward
            if layout.sp_kind == "ring"
            else [("all_to_all", act, "sp")] * 8  # q, k, v, out forward and backward
        )
        out += per_block * (n_blocks * m)
    if layout.ep > 1:
        moe_blocks = {_block_of(trace)[p.unit] for p in trace.params if _EXPERT.search(p.name)}
        chunks = _chunks(trace, layout)
        mine = [chunks[k] for k in range(step.rank, len(chunks), layout.pp)]
        n_moe = sum(1 for pos in moe_blocks if any(lo <= pos < hi for lo, hi in mine))
        out += [("all_to_all", act, "ep")] * (4 * n_moe * m)  # dispatch and combine, forward and backward
    return out


def _blocks_on_rank(trace: ModelTrace, layout: Layout, rank: int) -> int:
    chunks = _chunks(trace, layout)
    return sum(hi - lo for k, (lo, hi) in enumerate(chunks) if k % layout.pp == rank)


def model_flops(trace: ModelTrace, layout: Layout, batch: int) -> float:
    """FLOPs of the whole model's forward + backward (2x) for ``batch`` sequences (no
    recomputation), from a trace of ``trace.batch`` sequences of ``seq / sp`` tokens: matmuls
    scale with the tokens (``x sp``), attention with their square (``x sp^2``)."""
    s = layout.sp if layout.engine == "hybrid" else 1
    fwd = sum(f * (s * s if a else s) for f, a in zip(trace.flops[: trace.backward_start],
                                                   trace.attention[: trace.backward_start], strict=True))  # fmt: skip
    return 3 * fwd * batch / trace.batch
