"""What the recorders produce: plain records collected per step."""

from __future__ import annotations

import dataclasses

__all__ = ["Span", "CommRecord", "MemoryPoint", "ChunkMove", "StepRecord"]


@dataclasses.dataclass(slots=True)
class Span:
    """A named interval on one track (``phases``, ``modules``, ...); times in clock seconds."""

    name: str
    """Phase name (``forward``, ``backward``, ``optimizer``, user names) or module path."""
    track: str
    """Track (trace thread) the span belongs to; spans of one track nest."""
    start: float
    """Clock time at the start."""
    end: float
    """Clock time at the end."""
    args: dict = dataclasses.field(default_factory=dict)
    """Extra figures shown with the span (FLOPs, FLOP/s, depth)."""

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start


@dataclasses.dataclass(slots=True)
class CommRecord:
    """One collective as the profiler keeps it: the comm event plus caller and bandwidths."""

    op: str
    """Operation name (``all_reduce``, ``all_gather``, ...)."""
    group_size: int
    """Ranks in the group."""
    ranks: tuple[int, ...]
    """Global ranks of the group."""
    nbytes: int
    """Message size, nccl-tests convention."""
    wire_bytes: float
    """Bytes one rank sends with a ring algorithm: ``nbytes * bus_factor(op, n)``."""
    dtype: str
    """Element type, e.g. ``float32``."""
    async_op: bool
    """Issued asynchronously."""
    start: float
    """Issue time (``time.perf_counter`` seconds)."""
    end: float
    """Completion time (for async ops: when ``wait()`` returned)."""
    tag: str
    """Caller-provided label."""
    caller: str
    """``file:line (function)`` of the first frame outside colossal.* and torch.*."""
    wait: float = 0.0
    """Straggler wait: this rank's duration minus the fastest group member's (when gathered)."""

    @property
    def duration(self) -> float:
        """Seconds from issue to completion."""
        return self.end - self.start

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, bytes/s: ``nbytes / duration`` (0 for a zero duration)."""
        return self.nbytes / self.duration if self.duration > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bus bandwidth, bytes/s: ``algbw * bus_factor(op, n)`` (nccl-tests)."""
        return self.wire_bytes / self.duration if self.duration > 0 else 0.0


@dataclasses.dataclass(slots=True)
class MemoryPoint:
    """One sample of memory on one device or tier."""

    time: float
    """Clock time of the sample."""
    tier: str
    """Device or tier: ``cuda:0``, ``cpu``, or a Gemini/ZeRO tier name."""
    model_bytes: int
    """Parameters, gradients and optimizer states."""
    non_model_bytes: int
    """Everything else allocated (activations, buffers, workspace)."""
    label: str = ""
    """Where the sample was taken (phase or module boundary, or the source's label)."""
    source: str = "sampler"
    """``sampler`` (the profiler's own) or the module that published it."""


@dataclasses.dataclass(slots=True)
class ChunkMove:
    """A chunk moved between memory tiers (published by Gemini/ZeRO)."""

    chunk_id: int
    """Chunk identifier."""
    nbytes: int
    """Bytes moved."""
    src: str
    """Tier the bytes left."""
    dst: str
    """Tier the bytes reached."""
    start: float
    """``time.perf_counter`` at the start of the move."""
    end: float
    """... and at its end."""
    reason: str = ""
    """Why it moved (eviction, prefetch, ...)."""


@dataclasses.dataclass(slots=True)
class StepRecord:
    """Everything recorded during one step."""

    step: int
    """Step number (0-based, counted by ``Profiler.step()``)."""
    start: float
    """Clock time when the step began."""
    end: float = 0.0
    """Clock time when it ended."""
    spans: list[Span] = dataclasses.field(default_factory=list)
    """Phase and module spans."""
    comm: list[CommRecord] = dataclasses.field(default_factory=list)
    """Collectives, in completion order."""
    memory: list[MemoryPoint] = dataclasses.field(default_factory=list)
    """Memory samples, in time order per source."""
    moves: list[ChunkMove] = dataclasses.field(default_factory=list)
    """Chunk moves."""
    flops: int | None = None
    """FLOPs counted over the step (forward and backward), when counting."""

    @property
    def empty(self) -> bool:
        """Nothing happened but the profiler's own step-boundary memory samples."""
        return not (self.spans or self.comm or self.moves or any(m.source != "sampler" for m in self.memory))
