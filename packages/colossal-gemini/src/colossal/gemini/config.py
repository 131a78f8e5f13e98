"""Settings of :class:`~colossal.gemini.GeminiDDP`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["GeminiConfig"]

_PLACEMENTS = ("auto", "static")


@dataclasses.dataclass(kw_only=True, slots=True)
class GeminiConfig:
    """Settings of :class:`GeminiDDP`."""

    placement: str = "auto"
    """``"auto"`` (Belady on the traced sequence) or ``"static"`` (fixed offload fractions)."""
    device_memory_budget: int | None = None
    """Bytes the device tier may hold; default the real capacity on CUDA (required on CPU)."""
    mixed_precision: torch.dtype | None = None
    """Working precision ``torch.bfloat16`` / ``torch.float16``; ``None`` keeps fp32."""
    chunk_size: int | None = None
    """Elements per chunk; ``None`` searches the size that minimises padding."""
    offload_param_frac: float = 0.0
    """Static policy: fraction of working chunks homed on the host (fetched for each use)."""
    offload_optim_frac: float = 1.0
    """Static policy: fraction of optimizer blocks (fp32 master, gradient, states) on the host."""
    process_group: dist.ProcessGroup | None = None
    """Data-parallel group the chunks are sharded over (``None``: the world when initialised)."""
    param_init_fn: Callable[[str, torch.Tensor], None] | None = None
    """Fills a meta-device parameter (by name) in place, chunk by chunk (lazy construction)."""
    keep_gathered: bool = False
    """Data parallelism without sharding (plain-DDP behaviour, for models whose states fit each rank):
    every rank keeps whole chunks, gradients are all-reduced per chunk (asynchronously, overlapping
    backward) and every rank steps every chunk. ``False``: chunks are sharded over the ranks (ZeRO-3)."""
    example_inputs: tuple | torch.Tensor | None = None
    """Positional inputs of one forward call: when given, the forward runs once at construction on the
    meta device (no memory, no compute) and parameters are packed into chunks in the order modules
    first use them (see ``[Note: packing in first-use order]``); ``None`` packs in registration order."""
    prefetch: int = 2
    """Sharded data parallelism, after warm-up: after an operator's chunks are gathered, start the
    all-gathers of the next ``prefetch`` distinct chunks of the traced order asynchronously, so they
    overlap its compute (fewer where the traced budget cannot hold them; the same on every rank).
    ``0`` gathers every chunk on demand."""
    device: torch.device | str | None = None
    """Compute device; default ``cuda:<current>`` when CUDA is present, else ``cpu``."""
    checkpoint_timeout: float | None = None
    """Seconds every gather, save and load of the state (collectives: ``state_dict``,
    ``save_sharded``, ...) waits for all ranks of the group to call it before it raises a
    ``CheckpointError`` naming the ranks that did not ([Note: the arrival check] in
    ``colossal.comm.arrival``); ``None``: ``COLOSSAL_COMM_TIMEOUT`` if set, else 300."""

    def __post_init__(self):
        if self.placement not in _PLACEMENTS:
            raise ValueError(f"placement must be one of {_PLACEMENTS}, got {self.placement!r}")
        if self.mixed_precision not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"mixed_precision must be None, torch.bfloat16 or torch.float16, got {self.mixed_precision}"
            )
        for name in ("offload_param_frac", "offload_optim_frac"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive int of elements, got {self.chunk_size!r}")
        if not isinstance(self.keep_gathered, bool):
            raise ValueError(f"keep_gathered must be a bool, got {self.keep_gathered!r}")
        if isinstance(self.example_inputs, torch.Tensor):
            self.example_inputs = (self.example_inputs,)
        if self.example_inputs is not None and not isinstance(self.example_inputs, (tuple, list)):
            kind = type(self.example_inputs).__name__
            raise TypeError(f"example_inputs must be a tuple of positional inputs or a tensor, got {kind}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (chunks gathered ahead), got {self.prefetch!r}")
        timeout = self.checkpoint_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"checkpoint_timeout must be a positive number of seconds or None, got {timeout!r}")
        if self.device is None:
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
