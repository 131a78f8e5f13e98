"""Small differentiable building blocks shared by the modes (private)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.comm import all_gather_along_dim, copy_to_group, reduce_from_group

__all__ = ["all_reduce_sum", "gather_param", "shard_param", "rows_chunk", "group_size", "group_rank"]


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for ``None`` meaning "no group")."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over ``group`` whose backward also sums (every rank used the total): the statistics of a
    hidden-split LayerNorm."""
    return reduce_from_group(copy_to_group(x, group), group)


def gather_param(p: torch.Tensor, groups: Sequence[ProcessGroup], dim: int = 0) -> torch.Tensor:
    """All-gather a stored shard over ``groups`` (innermost first) along ``dim``; the backward
    reduce-scatters, i.e. sums the partial gradients of the ranks that shared the block."""
    for g in groups:
        if group_size(g) > 1:
            p = all_gather_along_dim(p, dim, g)
    return p


def shard_param(full: torch.Tensor, groups: Sequence[ProcessGroup], dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`gather_param`: this rank's stored shard of ``full`` (no communication)."""
    for g in reversed(groups):
        full = full.chunk(group_size(g), dim=dim)[group_rank(g)]
    return full.contiguous()


def rows_chunk(x: torch.Tensor, index: int, count: int, what: str = "batch") -> torch.Tensor:
    """Chunk ``index`` of ``count`` along dim 0 (no communication; ``x`` is replicated)."""
    if x.shape[0] % count:
        raise ValueError(f"{what} size {x.shape[0]} must be divisible by {count} (the number of row blocks)")
    return x.chunk(count, dim=0)[index]
