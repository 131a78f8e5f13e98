"""Memory events of colossal.zero: an observer registry (``colossal.comm.ObserverRegistry``, as Gemini's).

The profiler (or a test) registers a callable and receives frozen dataclasses with a ``kind``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from colossal.comm import ObserverHandle, ObserverRegistry

__all__ = ["ChunkMoveEvent", "MemorySample", "ObserverHandle", "register_observer", "emit", "has_observers"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkMoveEvent:
    """Bytes of one flat buffer moved between memory tiers (e.g. offloaded gradients to the CPU)."""

    kind: str = "chunk_move"
    """Always ``"chunk_move"``."""
    chunk_id: int = 0
    """Index of the flat buffer (bucket or stage-3 unit) that moved."""
    nbytes: int = 0
    """Bytes moved."""
    src: str = "cuda"
    """Tier the bytes left: ``"cuda"``, ``"cpu"`` or ``"disk"``."""
    dst: str = "cpu"
    """Tier the bytes reached."""
    start: float = 0.0
    """``time.perf_counter()`` when the move began."""
    end: float = 0.0
    """``time.perf_counter()`` when it finished."""
    reason: str = ""
    """Why it moved (e.g. ``"offload_grad"``, ``"offload_param"``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemorySample:
    """Model-state bytes held by this rank on one tier, sampled once per optimizer step."""

    kind: str = "memory_sample"
    """Always ``"memory_sample"``."""
    time: float = 0.0
    """``time.perf_counter()`` of the sample."""
    tier: str = "cpu"
    """Memory tier: ``"cuda"`` or ``"cpu"``."""
    model_bytes: int = 0
    """Parameters + gradients + optimizer states held by this rank on the tier."""
    non_model_bytes: int = 0
    """Everything else measured on the tier (0 when not measured)."""
    label: str = ""
    """Where in the step the sample was taken (e.g. ``"zero.step"``)."""


_REGISTRY = ObserverRegistry()


def register_observer(fn: Callable[[Any], None]) -> ObserverHandle:
    """Deliver every future :class:`MemorySample` / :class:`ChunkMoveEvent` of this process to ``fn``."""
    return _REGISTRY.register(fn)


def has_observers() -> bool:
    """True when at least one observer is registered."""
    return _REGISTRY.has_observers()


def emit(event: Any) -> None:
    """Deliver ``event`` to every observer."""
    _REGISTRY.emit(event)
