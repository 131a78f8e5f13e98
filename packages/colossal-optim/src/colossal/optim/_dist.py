"""Tiny torch.distributed helpers (colossal.optim depends on torch alone, not on colossal.comm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["AllReduce", "active_group", "comm_device", "all_reduce", "check_all_reduce"]


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


AllReduce = Callable[[torch.Tensor, dist.ReduceOp, ProcessGroup], Any]
"""An in-place all-reduce ``fn(tensor, op, group)``: ``torch.distributed.all_reduce`` or, in the
engines, ``colossal.comm.all_reduce`` (so the reduction shows up as a comm event)."""


def all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None, fn: AllReduce | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` with ``fn`` (default ``torch.distributed``'s);
    a no-op without a group or on a group of one. Returns ``tensor``."""
    if group is not None and dist.get_world_size(group) > 1:
        (fn or dist.all_reduce)(tensor, op, group)
    return tensor


def check_all_reduce(fn: Any) -> None:
    """Refuse a non-callable ``all_reduce=`` argument up front."""
    if fn is not None and not callable(fn):
        raise TypeError(f"all_reduce must be callable (tensor, op, group) or None, got {type(fn).__name__}")
