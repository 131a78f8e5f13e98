"""Per-step statistics of a Gemini-managed model."""

from __future__ import annotations

import dataclasses

__all__ = ["GeminiStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class GeminiStats:
    """What one training step cost in memory and movement (``GeminiDDP.stats`` / ``stats_history``)."""

    step: int
    """Step index (0 = the warm-up step, traced)."""
    policy: str
    """Placement policy in force during the step: ``"warmup"``, ``"static"`` or ``"auto"``."""
    bytes_to_device: int
    """Bytes copied into the device tier."""
    bytes_to_host: int
    """Bytes copied out of the device tier."""
    transfer_seconds: float
    """Wall time spent in those copies."""
    peak_model_bytes: int
    """Peak accounted model data on the device tier (chunks, gradient buffers, master/optimizer blocks)."""
    peak_non_model_bytes: int
    """Peak non-model data on the device (measured in warm-up, traced afterwards)."""
    peak_device_bytes: int
    """Peak of model + non-model data at the same moment (must stay within ``budget``)."""
    budget: int
    """Device budget in bytes."""
    chunks_on_device: int
    """Working chunks whose shard is on the device tier at the end of the step."""
    chunks_on_host: int
    """Working chunks whose shard is on the host tier at the end of the step."""
    optim_on_device: int
    """Chunks whose optimizer block (fp32 master, gradient, states) is on the device tier."""
    belady_bytes: int | None
    """Bytes the offline optimum (Belady on the traced sequence, same budget) would move per step."""

    disk_bytes_read: int = 0
    """Bytes read from the disk tier during the step (0 without one)."""
    disk_bytes_written: int = 0
    """Bytes written to the disk tier during the step."""
    disk_wait_seconds: float = 0.0
    """Seconds the training thread waited for disk I/O during the step."""
    belady_disk_bytes: int | None = None
    """Disk bytes per step of the offline two-level optimum (see ``belady_two_level``), same plan."""
    host_peak_bytes: int = 0
    """Peak accounted host-tier bytes so far (with a disk tier: within ``host_memory_budget``)."""
    host_rss_bytes: int | None = None
    """The process's real resident memory at the end of the step (``VmRSS``: everything, not only
    Gemini's; ``None`` without ``/proc``), to read next to the accounted ``host_peak_bytes``."""
    host_rss_peak_bytes: int | None = None
    """The process's peak resident memory since it started (the kernel's ``VmHWM``; see [Note: the
    allocator's peak] in ``host_memory.py``)."""

    @property
    def bytes_moved(self) -> int:
        """Bytes moved both ways."""
        return self.bytes_to_device + self.bytes_to_host
