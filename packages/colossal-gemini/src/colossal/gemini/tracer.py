"""Memory tracing during warm-up: non-model data per operator and the chunks each operator touches.

[Note: why track storages instead of reading allocator statistics]
Non-model data (activations, temporaries, autograd buffers) has to be known per operator on the
CPU as well as on CUDA, where ``torch.cuda.memory_allocated`` exists but cannot tell model from
non-model data by itself. :class:`NonModelTracker` is a ``TorchDispatchMode`` that sees every op's
outputs, and keeps a weak reference to each new storage that is not one of the chunk buffers; the
live non-model bytes are the sum over storages still alive. Views share their base's storage, so
nothing is counted twice. On CUDA the record also keeps ``memory_allocated() - model bytes`` as a
cross-check (``cuda_non_model_bytes``). The mode is only active during warm-up: afterwards the
trace drives placement and the hooks stay cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["NonModelTracker", "OpRecord", "Trace"]


@dataclasses.dataclass(slots=True)
class OpRecord:
    """One operator of the traced iteration (a module's forward or backward, or the optimizer step)."""

    label: str
    """``"fwd:<module>"``, ``"bwd:<module>"`` or ``"step"``."""
    chunk_ids: tuple[int, ...]
    """Chunks the operator computes with."""
    non_model_bytes: int = 0
    """Peak live non-model bytes between this operator's start and the next one's."""
    pinned_bytes: int = 0
    """Peak device bytes of gradient buffers during the operator (model data not placed by the policy)."""
    recompute_chunk_ids: tuple[int, ...] = ()
    """Chunks fetched during the operator for forwards recomputed inside backward (activation
    checkpointing); they are gathered next to the operator's own chunks."""
    held_chunk_ids: tuple[int, ...] = ()
    """Chunks outside ``chunk_ids`` that were gathered and could not be released when the operator began:
    a tensor waiting for its gradient (a tied weight, an unused parameter of a module that ran) in a chunk
    autograd still reads. They occupy the device next to the operator's own chunks (see ``[Note: held
    chunks]`` in ``ddp.py``)."""
    cuda_non_model_bytes: int | None = None
    """On CUDA: ``memory_allocated()`` minus accounted model data at the operator's start (cross-check)."""


@dataclasses.dataclass(slots=True)
class Trace:
    """The operator sequence of one training iteration, recorded during warm-up."""

    ops: list[OpRecord] = dataclasses.field(default_factory=list)
    """Operators in execution order."""

    def next_uses(self) -> dict[int, list[int]]:
        """For each chunk id, the operator indices that use it (ascending)."""
        uses: dict[int, list[int]] = {}
        for i, op in enumerate(self.ops):
            for c in op.chunk_ids:
                uses.setdefault(c, []).append(i)
        return uses

    @property
    def peak_non_model_bytes(self) -> int:
        """Largest non-model footprint of any operator."""
        return max((op.non_model_bytes for op in self.ops), default=0)

    def __len__(self) -> int:
        return len(self.ops)


def _never(key: int) -> bool:
    return False


class NonModelTracker(TorchDispatchMode):
    """Sums the bytes of live storages created by ops, except the model's (see the module note)."""

    def __init__(self, is_model: Callable[[int], bool]):
        super().__init__()
        self._is_model = is_model  # storage key -> True for chunk buffers
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._suspended = 0
        self.passthrough = False
        """Track nothing more: the iteration was abandoned inside backward, where the mode cannot be
        popped (``GeminiDDP._stop_tracking``); see :meth:`go_inert`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._suspended and not self.passthrough:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._track(t)
        return out

    def go_inert(self) -> None:
        """Stop tracking and drop every reference (the model's storage test, the live table): a mode
        that must stay pushed until the engine can pop it costs one Python call per operator and
        keeps nothing alive (the model can be collected while it waits)."""
        self.passthrough = True
        self._is_model = _never
        self._live.clear()
        self.live_bytes = 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            return
        if self._is_model(key):
            return
        self._purge()
        nbytes = storage.nbytes()
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _purge(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.live_bytes -= self._live.pop(k)[1]

    def current(self) -> int:
        """Live non-model bytes now."""
        self._purge()
        return self.live_bytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.current()

    @contextlib.contextmanager
    def suspended(self):
        """Do not track what runs inside (the engine's own moves of model data)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1
