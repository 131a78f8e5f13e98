"""Settings of :class:`~colossal.gemini.GeminiDDP`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from colossal.comm.knobs import as_bytes, as_count, as_dtype, as_fraction

__all__ = ["GeminiConfig"]

_PLACEMENTS = ("auto", "static")


@dataclasses.dataclass(kw_only=True, slots=True)
class GeminiConfig:
    """Settings of :class:`GeminiDDP`."""

    placement: str = "auto"
    """``"auto"`` (Belady on the traced sequence) or ``"static"`` (fixed offload fractions)."""
    device_memory_budget: int | str | None = None
    """Bytes the device tier may hold (an int or ``"64MiB"``: ``colossal.comm.as_bytes``); default the
    real capacity on CUDA, 1 GiB on the CPU (``CPU_DEFAULT_BUDGET``, with a warning)."""
    mixed_precision: torch.dtype | str | None = None
    """Working precision ``torch.bfloat16`` / ``torch.float16`` or its name (``"bf16"``, ``"fp16"``:
    ``colossal.comm.as_dtype``); ``None`` or fp32 keeps fp32."""
    chunk_size: int | None = None
    """Elements per chunk; ``None`` searches the size that minimises padding."""
    offload_param_frac: float = 0.0
    """Static policy: fraction of working chunks homed on the host (fetched for each use)."""
    offload_optim_frac: float = 1.0
    """Static policy: fraction of optimizer blocks (fp32 master, gradient, states) on the host."""
    group: dist.ProcessGroup | None = None
    """Data-parallel group the chunks are sharded over (``None``: the world when initialised); ``group``
    as in ``colossal.comm``, ``ZeroOptimizer`` and the tensor-parallel layers."""
    process_group: dist.ProcessGroup | None = None
    """The same as ``group`` (torch FSDP's spelling); giving both with different groups is an error."""
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
    disk_dir: str | os.PathLike | None = None
    """Directory of the disk tier's scratch files (one per rank, unlinked at creation: see
    ``colossal.gemini.disk``); ``None``: no disk tier."""
    host_memory_budget: int | str | None = None
    """Bytes (an int or ``"64MiB"``) of model data (and disk I/O buffers) the host tier may hold;
    required with ``disk_dir`` and ``placement="auto"``, which keeps optimizer blocks and working
    shards on the host up to it."""
    disk_param_frac: float = 0.0
    """Static policy with ``disk_dir``: fraction of chunks (the last ones) whose working shard and fp32
    master live on disk (at most ``offload_param_frac``: disk-homed shards are fetched for each use)."""
    disk_grad_frac: float = 0.0
    """Static policy with ``disk_dir``: fraction of chunks whose fp32 gradient shard lives on disk."""
    disk_optim_frac: float = 0.0
    """Static policy with ``disk_dir``: fraction of chunks whose optimizer states live on disk."""
    disk_io_threads: int = 2
    """Threads reading and writing the disk tier."""
    disk_prefetch: int = 2
    """Auto policy with ``disk_dir``: distinct chunks read ahead from disk in traced order."""

    def __post_init__(self):
        if self.process_group is not None:
            if self.group is not None and self.group is not self.process_group:
                raise ValueError("group= and process_group= name the same knob: pass one of them, got two groups")
            self.group = self.process_group
        self.process_group = self.group
        if self.placement not in _PLACEMENTS:
            raise ValueError(f"placement must be one of {_PLACEMENTS}, got {self.placement!r}")
        if self.mixed_precision is not None:  # one spelling everywhere: colossal.comm.knobs
            self.mixed_precision = as_dtype(self.mixed_precision, "mixed_precision")
        for name in ("device_memory_budget", "host_memory_budget"):
            if getattr(self, name) is not None:
                setattr(self, name, as_bytes(getattr(self, name), name))
        for name in (
            "offload_param_frac",
            "offload_optim_frac",
            "disk_param_frac",
            "disk_grad_frac",
            "disk_optim_frac",
        ):
            setattr(self, name, as_fraction(getattr(self, name), name))
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive int of elements, got {self.chunk_size!r}")
        if not isinstance(self.keep_gathered, bool):
            raise ValueError(f"keep_gathered must be a bool, got {self.keep_gathered!r}")
        if isinstance(self.example_inputs, torch.Tensor):
            self.example_inputs = (self.example_inputs,)
        if self.example_inputs is not None and not isinstance(self.example_inputs, (tuple, list)):
            kind = type(self.example_inputs).__name__
            raise TypeError(f"example_inputs must be a tuple of positional inputs or a tensor, got {kind}")
        self.prefetch = as_count(self.prefetch, "prefetch")  # chunks gathered ahead
        timeout = self.checkpoint_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"checkpoint_timeout must be a positive number of seconds or None, got {timeout!r}")
        self._check_disk()
        if self.device is None:
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    def _check_disk(self) -> None:
        fracs = {n: getattr(self, n) for n in ("disk_param_frac", "disk_grad_frac", "disk_optim_frac")}
        for n in ("disk_io_threads", "disk_prefetch"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if n == "disk_io_threads" else 0):
                raise ValueError(f"{n} must be an int >= {1 if n == 'disk_io_threads' else 0}, got {v!r}")
        if self.disk_dir is None:
            bad = {n: v for n, v in fracs.items() if v}
            if bad or self.host_memory_budget is not None:
                raise ValueError(f"{bad or 'host_memory_budget'} need disk_dir (the disk tier), got disk_dir=None")
            return
        if self.keep_gathered:
            raise ValueError("disk_dir is not supported with keep_gathered=True")
        if self.placement == "auto":
            if self.host_memory_budget is None:
                raise ValueError("placement='auto' with disk_dir needs host_memory_budget (bytes), got None")
            bad = {n: v for n, v in fracs.items() if v}
            if bad:
                raise ValueError(f"{bad} are static-placement settings; placement='auto' plans the disk itself")
        elif self.disk_param_frac > self.offload_param_frac:
            raise ValueError(
                f"disk_param_frac ({self.disk_param_frac}) must be <= offload_param_frac "
                f"({self.offload_param_frac}): disk-homed working shards are fetched for each use"
            )
