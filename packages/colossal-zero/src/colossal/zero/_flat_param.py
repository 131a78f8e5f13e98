"""One flat buffer of parameters split evenly over the shard group (a stage-1/2 bucket or one
stage-3 unit's parameters of one optimizer param group).

Layout (``N`` = shard group size, ``r`` = this rank)::

    full  (padded,)          = [p0.flatten() | p1.flatten() | ... | zeros(pad)]
    shard (padded // N,)     = full[r * shard_numel : (r + 1) * shard_numel]

Each original parameter keeps its identity (optimizer, hooks, ``named_parameters`` still see it);
its ``.data`` is re-pointed once, to a view of ``full``.

[Note: freeing by storage resize]
Stage 3 frees a unit by resizing the storage of ``full`` to 0 bytes and re-gathers into the
same storage (as FSDP2 does), instead of swapping ``.data`` to fresh tensors: autograd saves
views of the weights (``addmm`` keeps ``W.t()``), and a saved view would otherwise keep the old
gathered buffer alive from forward until backward, so parameters would never really be freed.
While a buffer is sharded its parameters have no storage: do not read them (use the engine's
``full_model_state_dict()``).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["FlatParam", "ShardedState", "ParamSlice"]


class ShardedState(enum.Enum):
    """Which memory of a :class:`FlatParam` currently holds the parameter values."""

    SHARDED = "sharded"
    """Only the local shard is held; parameters point at empty tensors (stage 3 at rest)."""
    GATHERING = "gathering"
    """An asynchronous all-gather of the full buffer is in flight (prefetch)."""
    UNSHARDED = "unsharded"
    """The full buffer is held and parameters are views into it."""


class ParamSlice(NamedTuple):
    """The part of one parameter that lies inside this rank's shard."""

    index: int
    """Position of the parameter in :attr:`FlatParam.params`."""
    param_start: int
    """First element (of the flattened parameter) inside the shard."""
    shard_start: int
    """Where that element sits in the shard."""
    numel: int
    """Number of elements inside the shard (> 0)."""


class FlatParam:
    """Bookkeeping for one flat, evenly sharded buffer of parameters."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group_index: int | None, world: int, rank: int):
        self.params = params
        self.names = names
        self.group_index = group_index
        """Index of the optimizer param group owning these parameters (``None``: not optimized)."""
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.padded_numel = -(-self.numel // world) * world
        self.shard_numel = self.padded_numel // world
        self.shard_start = rank * self.shard_numel
        self.world, self.rank = world, rank
        self.state = ShardedState.UNSHARDED
        self.full: torch.Tensor | None = None  # (padded_numel,) while unsharded
        self.shard: torch.Tensor | None = None  # (shard_numel,) stage 3's persistent local shard
        self.master: torch.Tensor | None = None  # (shard_numel,) fp32, the optimizer's parameter
        self.full_grad: torch.Tensor | None = None  # (padded_numel,) local gradient accumulation
        self.shard_grad: torch.Tensor | None = None  # (shard_numel,) sum over ranks of the gradients
        self.ready: set[int] = set()  # params whose gradient arrived in this backward
        self.got_grad: set[int] = set()  # params given a gradient since the last zero_grad (any pass)
        # Parameters whose gradients are reduced here (none for buffers outside the optimizer).
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad] if group_index is not None else []
        self.master_aliased = False  # master is the (fp32) shard of the working parameters itself
        self.unit = None  # stage 3: the Unit owning this buffer
        self.grad_dtype: torch.dtype | None = None  # dtype/device of gradient communication
        self.grad_device: torch.device | None = None

    def flatten(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new padded flat copy of the parameters' current values."""
        full = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
            full[off : off + n].copy_(p.detach().reshape(-1))
        return full

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice (a view) of a ``(padded_numel,)`` tensor."""
        return flat[self.shard_start : self.shard_start + self.shard_numel]

    def init_full(self, full: torch.Tensor) -> None:
        """Adopt ``full`` as the buffer for good and point every parameter at its view of it."""
        assert full.numel() == self.padded_numel, (full.numel(), self.padded_numel)
        self.full = full
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes, strict=True):
            p.data = full[off : off + n].view(shape)
        self.state = ShardedState.UNSHARDED

    def alloc_full(self) -> torch.Tensor:
        """Re-allocate the full buffer's storage (contents undefined) for a gather to fill in place."""
        if self.state is not ShardedState.SHARDED:
            raise RuntimeError(f"alloc_full from {self.state}, expected {ShardedState.SHARDED}")
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        return self.full

    def to_unsharded(self, gathered: torch.Tensor) -> None:
        """Make the buffer whole with the gathered ``(padded_numel,)`` values (no copy when the
        gather already wrote into ``full``, see :meth:`alloc_full`)."""
        if self.state is ShardedState.UNSHARDED:
            raise RuntimeError(f"to_unsharded from {self.state}, expected {ShardedState.SHARDED}/GATHERING")
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded_numel * self.full.element_size())
        if gathered.data_ptr() != self.full.data_ptr():
            self.full.copy_(gathered)
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        """Free the buffer's storage (see [Note: freeing by storage resize])."""
        if self.state is not ShardedState.UNSHARDED:
            raise RuntimeError(f"to_sharded from {self.state}, expected {ShardedState.UNSHARDED}")
        self.full.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    def grad_views(self) -> list[torch.Tensor]:
        """Every parameter's slot in ``full_grad``, shaped like it: one split for all of them and a view
        only where the parameter is not 1-D (host cost: a slice and a view per parameter would be two
        operators each, and stages 2-3 make a new buffer every step)."""
        pad = self.padded_numel - self.numel
        parts = self.full_grad.split_with_sizes(self.numels + [pad] if pad else self.numels)
        return [t if len(s) == 1 else t.view(s) for t, s in zip(parts, self.shapes, strict=False)]

    def slices(self) -> list[ParamSlice]:
        """The parts of each parameter inside this rank's shard, in order."""
        out, lo, hi = [], self.shard_start, self.shard_start + self.shard_numel
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(ParamSlice(i, a - off, a - lo, b - a))
        return out
