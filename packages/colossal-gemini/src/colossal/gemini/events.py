"""Memory events of Gemini: chunk moves between tiers and memory samples, published to observers.

The event shapes are the cross-package contract read (duck-typed) by ``colossal-profiler``.
With no observer registered, publishing costs one branch (``if events.has_observers()``); the
registry is a ``colossal.comm.ObserverRegistry``, the same mechanism as ZeRO's and comm's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from colossal.comm import ObserverHandle, ObserverRegistry

__all__ = ["ChunkMoveEvent", "MemorySample", "ObserverHandle", "register_observer", "has_observers", "emit", "label"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkMoveEvent:
    """Bytes of one chunk (or one of its buffers) copied from one tier to another."""

    kind: str = dataclasses.field(default="chunk_move", init=False)
    """Always ``"chunk_move"``."""
    chunk_id: int
    """Index of the chunk in its manager."""
    nbytes: int
    """Bytes copied."""
    src: str
    """Source tier device type: ``"cuda"``, ``"cpu"`` or ``"disk"``."""
    dst: str
    """Destination tier device type."""
    start: float
    """``time.perf_counter()`` when the copy started."""
    end: float
    """``time.perf_counter()`` when it finished."""
    reason: str
    """Why it moved: ``"fetch"``, ``"evict"``, ``"grad_offload"``, ``"param_refresh"``, ``"placement"``;
    with a disk tier also ``"prefetch"``, ``"optim_read"``, ``"optim_write"``, ``"grad_check"``,
    ``"checkpoint"`` and ``"io_wait"`` (``nbytes=0``: the training thread waited for disk I/O)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemorySample:
    """Memory held on one tier at one moment, split into model and non-model data."""

    kind: str = dataclasses.field(default="memory_sample", init=False)
    """Always ``"memory_sample"``."""
    time: float
    """``time.perf_counter()`` of the sample."""
    tier: str
    """Tier device type: ``"cuda"``, ``"cpu"`` or ``"disk"``."""
    model_bytes: int
    """Bytes of model data (chunks, gradients, master weights, optimizer states) on the tier."""
    non_model_bytes: int
    """Bytes of non-model data (activations, temporaries) on the tier (traced or estimated)."""
    label: str
    """Operator or phase the sample was taken at (e.g. ``"fwd:blocks.0.attn.q_proj"``)."""


_REGISTRY = ObserverRegistry()


def register_observer(fn: Callable[[Any], None]) -> ObserverHandle:
    """Deliver every :class:`ChunkMoveEvent` and :class:`MemorySample` to ``fn`` until removed."""
    return _REGISTRY.register(fn)


def has_observers() -> bool:
    """True when at least one observer is registered."""
    return _REGISTRY.has_observers()


def emit(event: Any) -> None:
    """Deliver ``event`` to every observer."""
    _REGISTRY.emit(event)


def label(phase: str):
    """``record_function("colossal.gemini::<phase>")`` while a profiler runs, else a no-op (hooks stay cheap)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"colossal.gemini::{phase}")
    return contextlib.nullcontext()
