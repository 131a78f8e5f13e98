"""Configuration of the ZeRO engine."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm.knobs import as_count, as_dtype, as_fraction

__all__ = ["ZeroConfig", "ShardStrategy"]


class ShardStrategy(enum.IntEnum):
    """What is partitioned over the data-parallel shard group (the ZeRO stages)."""

    OPTIMIZER = 1
    """Stage 1 (P_os): fp32 master weights and optimizer states; full gradients kept on every rank."""
    GRADIENTS = 2
    """Stage 2 (P_os+g): also gradients (each bucket is reduce-scattered, then freed)."""
    PARAMETERS = 3
    """Stage 3 (P_os+g+p): also parameters (gathered per module just before use, freed after)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """Everything :class:`~colossal.zero.ZeroOptimizer` can be told; validated on construction."""

    stage: int = 2
    """ZeRO stage: 1, 2 or 3 (see :class:`ShardStrategy`)."""
    group: ProcessGroup | None = None
    """Shard group (data-parallel ranks that split the model states); ``None`` = the world."""
    replicate_group: ProcessGroup | None = None
    """Optional outer replicate group (HSDP): shards are identical across it and gradients are
    all-reduced over it after the reduce-scatter. Every stage."""
    param_dtype: torch.dtype | str = torch.float32
    """Dtype of the working parameters and of gradient communication (fp32, fp16 or bf16, or their
    names: ``colossal.comm.as_dtype``). Master weights and optimizer states are always fp32."""
    mixed_precision: torch.dtype | str | None = None
    """The same knob under the name ``GeminiDDP`` and the ``Booster`` use (``torch.bfloat16`` or
    ``"bf16"``, ...): sets ``param_dtype``; giving both with different values is an error."""
    initial_scale: float = 2.0**16
    """fp16 only: initial dynamic loss scale."""
    growth_interval: int = 1000
    """fp16 only: clean steps between loss-scale growths."""
    hysteresis: int = 2
    """fp16 only: overflows tolerated before the scale backs off."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm (over all shards) to this value; ``None`` = no clipping."""
    offload: bool = False
    """ZeRO-Offload: fp32 master shards, their gradients and optimizer states on the CPU; the
    optimizer step runs there (use ``colossal.optim.HybridAdam``/``CPUAdam``). The shorthand for
    ``offload_optim_frac=1.0``."""
    offload_optim_frac: float | None = None
    """Fraction of the flat buffers (buckets, stage 3's units) whose fp32 master, gradient and
    optimizer states live on the CPU: the last ``round(frac * n)`` of them, as Gemini's static policy
    takes its ``offload_optim_frac`` (the same name and type). The rest step on the device; torch's
    optimizers and ``HybridAdam`` step each device's tensors together. ``None``: ``1.0`` with
    ``offload=True``, else ``0.0``; giving ``offload=True`` with another fraction is an error."""
    bucket_numel: int = 2**22
    """Stages 1/2: maximum elements per gradient bucket (one reduce-scatter each)."""
    max_inflight: int = 2
    """Gradient reductions allowed in flight before the oldest is waited on (bounds memory)."""
    wrap_policy: Callable[[nn.Module], bool] | tuple[type[nn.Module], ...] | None = None
    """Stage 3: which submodules get their own gather/free unit (a predicate or module types);
    ``None`` = every child of every ``nn.ModuleList``. The root is always a unit."""
    reshard_root: bool = False
    """Stage 3: also free the root unit after forward (re-gathered for backward). Off by default,
    like FSDP2: the root's backward starts right after its forward, so freeing it would only
    add one gather (the paper's 3 psi per step counts it; with this off it is 3 psi - psi_root)."""
    prefetch: int = 1
    """Stage 3: after a unit is gathered, start the all-gathers of the next ``prefetch`` units (in the
    recorded forward order, and the previous ones in backward) so they overlap its compute; ``0``
    gathers each unit on demand. An ``int`` as ``GeminiDDP``'s ``prefetch`` (which counts chunks);
    each unit gathered ahead holds its full parameters until it runs."""
    sync_module_states: bool = True
    """Broadcast the parameters from rank 0 at construction so every rank starts identical."""
    overlap_param_gather: bool = False
    """Stages 1/2: start the all-gather of the updated parameters at the end of ``step()`` and
    wait for each bucket only in the forward pre-hook of a module owning one of its parameters,
    so the gather overlaps the next forward (Megatron's ``overlap_param_gather``). Until then the
    parameters are stale: read them outside a forward only after ``zero.wait_params()``."""
    checkpoint_timeout: float | None = None
    """Seconds every save/load entry point (``state_dict``, ``full_model_state_dict``,
    ``save_sharded``, ...: collectives) waits for all ranks of the group to call it before it
    raises a ``CheckpointError`` naming the ranks that did not ([Note: the arrival check] in
    ``colossal.comm.arrival``); ``None``: ``COLOSSAL_COMM_TIMEOUT`` if set, else 300."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        self.prefetch = as_count(self.prefetch, "prefetch")
        if not isinstance(self.offload, bool):
            raise TypeError(f"offload must be a bool (or pass offload_optim_frac=), got {self.offload!r}")
        if self.offload_optim_frac is not None:  # kept as given (dataclasses.replace sees the user's knobs)
            self.offload_optim_frac = as_fraction(self.offload_optim_frac, "offload_optim_frac")
            if self.offload and self.offload_optim_frac != 1.0:
                raise ValueError(
                    "offload=True means offload_optim_frac=1.0, "
                    f"got offload_optim_frac={self.offload_optim_frac}: pass one"
                )
        self.param_dtype = as_dtype(self.param_dtype, "param_dtype")
        if self.mixed_precision is not None:
            precision = as_dtype(self.mixed_precision, "mixed_precision")
            if self.param_dtype not in (torch.float32, precision):
                raise ValueError(
                    f"mixed_precision={self.mixed_precision!r} and param_dtype={self.param_dtype} disagree: pass one"
                )
            self.param_dtype = precision
        for name in ("group", "replicate_group"):
            value = getattr(self, name)
            if value is dist.GroupMember.NON_GROUP_MEMBER:
                raise ValueError(f"{name}: this rank is not a member of it (new_group gave NON_GROUP_MEMBER)")
            if value is not None and not isinstance(value, ProcessGroup):
                raise TypeError(f"{name} must be a ProcessGroup or None, got {type(value).__name__}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.bucket_numel < 1 or self.max_inflight < 1:
            raise ValueError(
                f"bucket_numel and max_inflight must be >= 1, got {self.bucket_numel} and {self.max_inflight}"
            )
        if self.overlap_param_gather and self.stage == 3:
            raise ValueError(
                "overlap_param_gather applies to stages 1 and 2 (stage 3 prefetches per unit), got stage 3"
            )
        if self.initial_scale <= 0:
            raise ValueError(f"initial_scale must be positive, got {self.initial_scale}")
        timeout = self.checkpoint_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"checkpoint_timeout must be a positive number of seconds or None, got {timeout!r}")

    @property
    def offload_fraction(self) -> float:
        """The fraction of flat buffers offloaded: ``offload_optim_frac``, else 1.0 with ``offload=True``,
        else 0.0."""
        if self.offload_optim_frac is not None:
            return self.offload_optim_frac
        return 1.0 if self.offload else 0.0

    @property
    def strategy(self) -> ShardStrategy:
        """The stage as a :class:`ShardStrategy`."""
        return ShardStrategy(self.stage)

    def world(self) -> tuple[int, int]:
        """``(shard group size, replicate group size)``."""
        rep = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
        return dist.get_world_size(self.group), rep
