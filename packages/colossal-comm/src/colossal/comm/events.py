"""Communication events: every collective issued through ``colossal.comm`` reports one.

Observers are plain callables taking a :class:`CommEvent`. With none registered, issuing a
collective costs one branch (``if _OBSERVERS``); with some, one event object per call.

[Note: what ``nbytes`` means]
``nbytes`` follows the nccl-tests convention of the *message size* of an operation, so that
``algbw = nbytes / time`` and ``busbw = algbw * bus_factor(op, n)`` read exactly like nccl-tests:

* ``all_reduce``, ``broadcast``, ``reduce``: the size of the tensor;
* ``all_gather``: the size of the gathered (output) tensor, i.e. ``n`` times the input;
* ``reduce_scatter``: the size of the (unscattered) input tensor, i.e. ``n`` times the output;
* ``all_to_all``: the size of the input tensor (equal to the output for even splits);
* ``send``, ``recv``, ``ring_exchange``: the size of the tensor sent or received;
* ``batch_p2p``: the total size of the tensors sent.

``wire_bytes`` is what one rank sends over its links for a bandwidth-optimal (ring) algorithm:
``nbytes * bus_factor(op, n)``. Tests that check communication volume against theory sum it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CommEvent",
    "CommCounter",
    "ObserverHandle",
    "ObserverRegistry",
    "bus_factor",
    "register_observer",
    "has_observers",
    "emit",
]


@dataclasses.dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective or point-to-point operation, reported when it completes."""

    op: str
    """Operation name: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
    ``broadcast``, ``reduce``, ``send``, ``recv``, ``batch_p2p``, ``ring_exchange``."""
    group_size: int
    """Number of ranks in the process group the operation ran on."""
    ranks: tuple[int, ...]
    """Global ranks of that group, in group-rank order (for p2p: ``(self, peer)``)."""
    nbytes: int
    """Message size in bytes, nccl-tests convention (see the module note)."""
    dtype: torch.dtype
    """Element type of the message."""
    async_op: bool
    """Whether the caller issued it asynchronously (start and wait are separate calls)."""
    start: float
    """``time.perf_counter()`` when the operation was issued."""
    end: float
    """``time.perf_counter()`` when it completed (for async ops: when ``wait()`` returned)."""
    tag: str = ""
    """Free label from the caller (e.g. ``"zero.reduce_scatter_bucket"``)."""

    @property
    def duration(self) -> float:
        """Seconds between issue and completion."""
        return self.end - self.start

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends with a bandwidth-optimal algorithm: ``nbytes * bus_factor``."""
        return self.nbytes * bus_factor(self.op, self.group_size)

    @property
    def numel(self) -> int:
        """Message size in elements."""
        return self.nbytes // _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` on ``n`` ranks (``busbw = algbw * factor``)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "batch_p2p", "ring_exchange"):
        return 1.0
    raise ValueError(f"unknown communication op {op!r}")


class ObserverRegistry:
    """A set of observers (plain callables) to deliver events to.

    ``colossal.comm`` keeps one for its :class:`CommEvent`; ZeRO and Gemini keep one each for
    their memory events, so the mechanism exists once. Hot paths test :meth:`has_observers`
    before building an event: with nobody listening the cost is one branch.
    """

    def __init__(self) -> None:
        self._observers: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()

    def register(self, fn: Callable[[Any], None]) -> ObserverHandle:
        """Deliver every future event to ``fn`` until the returned handle is removed."""
        if not callable(fn):
            raise TypeError(f"observer must be callable, got {type(fn).__name__}")
        with self._lock:
            self._observers.append(fn)
        return ObserverHandle(self, fn)

    def unregister(self, fn: Callable[[Any], None]) -> None:
        """Stop delivering events to ``fn`` (idempotent)."""
        with self._lock:
            if fn in self._observers:
                self._observers.remove(fn)

    def has_observers(self) -> bool:
        """True when at least one observer is registered."""
        return bool(self._observers)

    def emit(self, event: Any) -> None:
        """Deliver ``event`` to every observer (a snapshot, so observers may unregister)."""
        for fn in tuple(self._observers):
            fn(event)


class ObserverHandle:
    """Returned by ``register_observer``; ``remove()`` (or leaving the ``with``) unregisters."""

    def __init__(self, registry: ObserverRegistry, fn: Callable[[Any], None]):
        self._registry = registry
        self._fn = fn

    def remove(self) -> None:
        """Stop delivering events to the observer (idempotent)."""
        self._registry.unregister(self._fn)

    def __enter__(self) -> ObserverHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


_COMM_OBSERVERS = ObserverRegistry()


def register_observer(fn: Callable[[CommEvent], None]) -> ObserverHandle:
    """Deliver every future :class:`CommEvent` of this process to ``fn``."""
    return _COMM_OBSERVERS.register(fn)


def has_observers() -> bool:
    """True when at least one comm observer is registered (the one branch on the hot path)."""
    return bool(_COMM_OBSERVERS._observers)


def emit(event: CommEvent) -> None:
    """Deliver ``event`` to every comm observer."""
    _COMM_OBSERVERS.emit(event)


class CommCounter:
    """Observer that totals calls, message bytes and wire bytes per op (and per tag).

    Use as a context manager around the code to measure::

        with CommCounter() as counter:
            step()
        counter.nbytes["all_reduce"], counter.wire_bytes["reduce_scatter"]
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        """Number of operations per op name."""
        self.nbytes: dict[str, int] = defaultdict(int)
        """Sum of message sizes per op name (see the module note)."""
        self.wire_bytes: dict[str, float] = defaultdict(float)
        """Sum of per-rank wire bytes per op name."""
        self.by_tag: dict[str, int] = defaultdict(int)
        """Sum of message sizes per caller tag."""
        self.events: list[CommEvent] = []
        """Every event seen, in completion order."""
        self._handle: ObserverHandle | None = None

    def __call__(self, event: CommEvent) -> None:
        self.calls[event.op] += 1
        self.nbytes[event.op] += event.nbytes
        self.wire_bytes[event.op] += event.wire_bytes
        self.by_tag[event.tag] += event.nbytes
        self.events.append(event)

    @property
    def total_nbytes(self) -> int:
        """Message bytes over all ops."""
        return sum(self.nbytes.values())

    @property
    def total_wire_bytes(self) -> float:
        """Wire bytes over all ops."""
        return sum(self.wire_bytes.values())

    def reset(self) -> None:
        """Forget everything counted so far."""
        for d in (self.calls, self.nbytes, self.wire_bytes, self.by_tag):
            d.clear()
        self.events.clear()

    def __enter__(self) -> CommCounter:
        self._handle = register_observer(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
