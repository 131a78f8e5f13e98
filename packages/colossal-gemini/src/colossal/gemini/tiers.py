"""Memory tiers: where chunk buffers live, with byte accounting and counted moves between tiers.

A tier owns two things: the accounting of the model data placed on it, and the allocation of
tensors there. Policies see tiers only through :class:`Tier` (``used_bytes``, ``budget``,
``kind``), so a disk tier can be added without touching them.

[Note: CPU-only runs]
Without CUDA the compute device *is* the CPU: :class:`DeviceTier` is CPU memory with a budget
enforced by accounting, and :class:`HostTier` is CPU memory too. A move between them is a real,
accounted copy into a fresh buffer (not a relabel): it keeps the code path identical to the CUDA
one (same buffers freed, same copies issued), so step times and byte counts measured on CPU
include the cost of every move the policy decided, and a bug that forgets to move a buffer shows
up as an accounting error instead of silently working because both tiers share one memory.

[Note: the chunk-buffer pool]
On the CPU the device tier's chunk buffers come from ``malloc``. Where the user bounds host memory,
Gemini fixes glibc's mmap threshold (``[Note: the allocator's peak]`` in ``host_memory``), so every
chunk buffer is its own mapping: freeing it returns it to the kernel (the peak stays bounded), but
every fetch maps fresh pages and faults them in again. :class:`DeviceTier` therefore keeps the
storages of released chunk payloads (``keep_buffer``) and hands them to the next payload of the same
size (``take_buffer``: the payload's storage takes the pooled bytes, ``_swap_data_ptr_``), as long as
the accounted model data, the pool and the non-model bytes the placement policy keeps free for the
coming operator (``set_reserve``: the traced activations) together stay within the budget: the pool
gives way (buffers are freed) before any charge or reserve would pass it, so pooling never raises
the real peak above what the policy planned.
Only on the CPU: CUDA's caching allocator already reuses its blocks. ``pooled_bytes`` is the pool.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable

import torch

from colossal.comm.knobs import as_bytes
from colossal.gemini import events

__all__ = ["CPU_DEFAULT_BUDGET", "Tier", "DeviceTier", "HostTier", "BudgetExceededError", "Traffic", "transfer"]

CPU_DEFAULT_BUDGET = 1 << 30
"""Device budget when the compute device is the CPU and none is given (1 GiB, accounted: the "device"
is host memory there); the same in ``GeminiDDP`` and ``GeminiPlugin``, announced by a warning."""


class BudgetExceededError(RuntimeError):
    """The device tier cannot hold what is asked of it; the message says need, budget and what to change."""


class Tier:
    """A pool of memory holding model data, with its accounting."""

    name: str = "tier"
    """Role of the tier: ``"device"``, ``"host"`` (or ``"disk"``)."""

    def __init__(self, device: torch.device | str, budget: int | None = None):
        self.device = torch.device(device)
        self.budget = budget  # bytes; None = unlimited
        self.used_bytes = 0  # model data currently accounted here
        self.advice: Callable[[], str] | None = None  # what a budget error suggests (set by the tier's owner)
        self.peak_bytes = 0

    @property
    def kind(self) -> str:
        """Device type reported in events (``"cuda"``, ``"cpu"``, ``"disk"``)."""
        return self.device.type

    def charge(self, nbytes: int, what: str = "model data") -> None:
        """Account ``nbytes`` more model data; raises :class:`BudgetExceededError` past the budget."""
        if self.budget is not None and self.used_bytes + nbytes > self.budget:
            advice = self.advice() if self.advice else "raise device_memory_budget or offload more"
            raise BudgetExceededError(
                f"{self.name} tier: need {self.used_bytes + nbytes} bytes of model data for {what}, "
                f"budget {self.budget} bytes; {advice}"
            )
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def refund(self, nbytes: int) -> None:
        """Stop accounting ``nbytes`` of model data."""
        if nbytes > self.used_bytes:
            raise RuntimeError(f"{self.name} tier: refund of {nbytes} bytes exceeds the {self.used_bytes} accounted")
        self.used_bytes -= nbytes

    def alloc(self, numel: int, dtype: torch.dtype, what: str = "model data") -> torch.Tensor:
        """An accounted, uninitialised ``(numel,)`` tensor on this tier."""
        nbytes = numel * _itemsize(dtype)
        self.charge(nbytes, what)
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self._pin())

    def free(self, tensor: torch.Tensor) -> None:
        """Stop accounting ``tensor`` (the caller drops its references)."""
        self.refund(tensor.numel() * tensor.element_size())

    def _pin(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, used={self.used_bytes}, budget={self.budget})"


class DeviceTier(Tier):
    """The compute device with a byte budget (default: its real capacity on CUDA, :data:`CPU_DEFAULT_BUDGET`
    on the CPU)."""

    name = "device"

    def __init__(self, device: torch.device | str, budget: int | None = None):
        device = torch.device(device)
        if budget is None:
            if device.type == "cuda":
                budget = torch.cuda.get_device_properties(device).total_memory
            else:
                warnings.warn(
                    "device_memory_budget not given and the compute device is the CPU: using 1 GiB "
                    "(CPU_DEFAULT_BUDGET; the 'device' is host memory, and the budget is what makes Gemini "
                    "offload); pass e.g. device_memory_budget='4GiB' to choose",
                    stacklevel=4,
                )
                budget = CPU_DEFAULT_BUDGET
        super().__init__(device, as_bytes(budget, "device_memory_budget"))
        self.pooling = device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")
        """Whether released chunk buffers are kept for reuse (``[Note: the chunk-buffer pool]``)."""
        self.pooled_bytes = 0
        """Bytes of released chunk buffers kept for reuse (not model data: not in ``used_bytes``)."""
        self.reserve_bytes = 0
        """Non-model bytes the placement policy keeps free for the coming operator (``set_reserve``)."""
        self._pool: dict[int, list[torch.UntypedStorage]] = {}

    def charge(self, nbytes: int, what: str = "model data") -> None:
        """Account ``nbytes`` more model data (see :meth:`Tier.charge`); pooled buffers are freed first
        where model data, reserve and pool together would pass the budget."""
        super().charge(nbytes, what)
        self._trim(self.budget - self.used_bytes - self.reserve_bytes)

    def set_reserve(self, nbytes: int) -> None:
        """Keep ``nbytes`` free for non-model data (the coming operator's activations): the pool shrinks
        to fit next to them."""
        self.reserve_bytes = max(int(nbytes), 0)
        self._trim(self.budget - self.used_bytes - self.reserve_bytes)

    def take_buffer(self, nbytes: int) -> torch.UntypedStorage | None:
        """A pooled storage of exactly ``nbytes`` (removed from the pool), or ``None``."""
        free = self._pool.get(nbytes)
        if not free:
            return None
        self.pooled_bytes -= nbytes
        return free.pop()

    def keep_buffer(self, storage: torch.UntypedStorage) -> bool:
        """Move ``storage``'s bytes into the pool (``storage`` is left with 0 bytes) if the budget has room
        for them next to the accounted model data; ``False`` (nothing done) otherwise."""
        nbytes = storage.nbytes()
        room = self.budget - self.used_bytes - self.reserve_bytes
        if not self.pooling or nbytes == 0 or self.pooled_bytes + nbytes > room:
            return False
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._pool.setdefault(nbytes, []).append(holder)
        self.pooled_bytes += nbytes
        return True

    def _trim(self, room: int) -> None:
        """Free pooled buffers until the pool fits in ``room`` bytes."""
        while self.pooled_bytes > max(room, 0):
            size = max(n for n, free in self._pool.items() if free)
            self._pool[size].pop()
            self.pooled_bytes -= size


class HostTier(Tier):
    """Host memory, unlimited; pinned when the compute device is CUDA (fast, async copies)."""

    name = "host"

    def __init__(self, pin: bool = False):
        super().__init__("cpu", None)
        self.pin = pin and torch.cuda.is_available()

    def _pin(self) -> bool:
        return self.pin


@dataclasses.dataclass(slots=True)
class Traffic:
    """Bytes moved between tiers and time spent moving them (reset per step by the engine)."""

    to_device: int = 0
    """Bytes copied into the device tier."""
    to_host: int = 0
    """Bytes copied out of the device tier."""
    seconds: float = 0.0
    """Wall time spent in those copies."""

    def total(self) -> int:
        """Bytes moved both ways."""
        return self.to_device + self.to_host


def transfer(
    src_tensor: torch.Tensor, src: Tier, dst: Tier, traffic: Traffic, chunk_id: int, reason: str
) -> torch.Tensor:
    """Copy ``src_tensor`` (accounted on ``src``) into a new buffer on ``dst``; frees it on ``src``.

    The copy is counted in ``traffic`` and reported as a :class:`~colossal.gemini.events.ChunkMoveEvent`.
    """
    start = time.perf_counter()
    out = dst.alloc(src_tensor.numel(), src_tensor.dtype, what=f"chunk {chunk_id} ({reason})")
    out.copy_(src_tensor.view(-1))
    src.free(src_tensor)
    count(traffic, src, dst, out.numel() * out.element_size(), chunk_id, reason, start)
    return out


def count(traffic: Traffic, src: Tier, dst: Tier, nbytes: int, chunk_id: int, reason: str, start: float) -> None:
    """Record a copy of ``nbytes`` from ``src`` to ``dst`` that started at ``start``."""
    end = time.perf_counter()
    if dst.name == "device" and src.name != "device":
        traffic.to_device += nbytes
    elif src.name == "device" and dst.name != "device":
        traffic.to_host += nbytes
    traffic.seconds += end - start
    if events.has_observers():
        events.emit(
            events.ChunkMoveEvent(
                chunk_id=chunk_id, nbytes=nbytes, src=src.kind, dst=dst.kind, start=start, end=end, reason=reason
            )
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
