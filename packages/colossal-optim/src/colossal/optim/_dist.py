"""Tiny torch.distributed helpers (colossal.optim depends on torch alone, not on colossal.comm)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["active_group", "comm_device", "all_reduce"]


def active_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group``, the default group when ``group`` is None and torch.distributed is up, else None."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def comm_device(group: ProcessGroup | None, fallback: torch.device) -> torch.device:
    """Where a small tensor must live to be all-reduced over ``group`` (NCCL needs CUDA, gloo CPU)."""
    if group is None:
        return fallback
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend and "nccl" not in backend:
        return torch.device("cpu")
    return fallback  # a multi-device backend ("cpu:gloo,cuda:nccl") or another one: stay put


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (no-op without a group); return it."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor
