"""Interval arithmetic and the derived per-step figures (compute, communication, overlap, idle).

[Note: what counts as compute and as communication]
Communication is the union of the collectives' issue-to-completion intervals. Compute is the union
of the phase spans (forward, backward, optimizer, user phases) *minus* the synchronous collectives
inside them: while a blocking collective runs, the host does not compute. Asynchronous collectives
stay inside compute, and the time they share with it is the overlap. Exposed communication is
communication not hidden behind compute (``comm - overlap``), and idle is the part of the step
covered by neither. Times are host times: on CUDA a kernel may still run after its launch returns,
so these figures describe what the host waited for, which is what an exposed collective costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from colossal.profiler.records import StepRecord

__all__ = ["union", "intersect", "subtract", "measure", "StepFigures", "step_figures"]

Intervals = list[tuple[float, float]]


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint intervals covering the same points (empty intervals dropped)."""
    out: Intervals = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Points in both unions ``a`` and ``b`` (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Points of ``a`` not in ``b`` (each sorted and disjoint)."""
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
        if end > start:
            out.append((start, end))
    return out


def measure(intervals: Intervals) -> float:
    """Total length of sorted, disjoint intervals."""
    return sum((end - start for start, end in intervals), 0.0)


@dataclasses.dataclass(kw_only=True, slots=True)
class StepFigures:
    """Derived figures of one step (seconds, bytes, FLOPs)."""

    step: int
    """Step number."""
    step_time: float
    """Wall time of the step."""
    compute: float
    """Compute time (see the module note)."""
    comm: float
    """Time with at least one collective in flight."""
    overlap: float
    """Communication hidden behind compute."""
    exposed_comm: float
    """Communication not hidden: ``comm - overlap``."""
    idle: float
    """Neither compute nor communication."""
    comm_calls: int
    """Number of collectives."""
    comm_bytes: int
    """Sum of message sizes."""
    wire_bytes: float
    """Sum of per-rank wire bytes."""
    straggler_wait: float = 0.0
    """Sum over collectives of this rank's wait beyond the fastest rank."""
    peak_memory: int = 0
    """Largest sampled model + non-model bytes on any one device."""
    flops: int | None = None
    """FLOPs counted over the step."""
    flops_per_s: float | None = None
    """Achieved FLOP/s over the step."""
    mfu: float | None = None
    """``flops_per_s / peak_flops``."""
    tokens_per_s: float | None = None
    """``tokens_per_step / step_time``."""


_PHASE_TRACK = "phases"


def step_figures(rec: StepRecord, *, tokens: int | None = None, peak_flops: float | None = None) -> StepFigures:
    """Derive :class:`StepFigures` from one step's records."""
    comm = union((c.start, c.end) for c in rec.comm)
    blocking = union((c.start, c.end) for c in rec.comm if not c.async_op)
    phases = union((s.start, s.end) for s in rec.spans if s.track == _PHASE_TRACK)
    compute = subtract(phases, blocking)
    overlap = measure(intersect(compute, comm))
    busy = measure(union(compute + comm))
    step_time = rec.end - rec.start
    flops_per_s = rec.flops / step_time if rec.flops is not None and step_time > 0 else None
    return StepFigures(
        step=rec.step,
        step_time=step_time,
        compute=measure(compute),
        comm=measure(comm),
        overlap=overlap,
        exposed_comm=measure(comm) - overlap,
        idle=max(step_time - busy, 0.0),
        comm_calls=len(rec.comm),
        comm_bytes=sum(c.nbytes for c in rec.comm),
        wire_bytes=sum(c.wire_bytes for c in rec.comm),
        straggler_wait=sum(c.wait for c in rec.comm),
        peak_memory=max((m.model_bytes + m.non_model_bytes for m in rec.memory), default=0),
        flops=rec.flops,
        flops_per_s=flops_per_s,
        mfu=flops_per_s / peak_flops if flops_per_s is not None and peak_flops else None,
        tokens_per_s=tokens / step_time if tokens and step_time > 0 else None,
    )
