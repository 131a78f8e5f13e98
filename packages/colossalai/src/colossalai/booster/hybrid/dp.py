"""The data-parallel axis of the hybrid plugin: DDP over ``dp`` (x ``sp``), or ZeRO (:mod:`.zero`),
or, under pipeline parallelism, a flat gradient average after each step (:mod:`.pp`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["apply_ddp", "dp_group"]


def dp_group(mesh, sp_size: int):
    """The group gradients are averaged over: ``dp``, times ``sp`` with sequence parallelism
    (sp ranks see different tokens of the same samples)."""
    return mesh.product_group("dp", "sp") if sp_size > 1 else mesh.group("dp")


def apply_ddp(wrapped: nn.Module, group, device: torch.device, find_unused_parameters: bool = False) -> nn.Module:
    """``wrapped`` in DDP over ``group`` (unchanged when the group has one rank)."""
    if torch.distributed.get_world_size(group) == 1:
        return wrapped
    ids = [device.index] if device.type == "cuda" else None
    return DDP(wrapped, device_ids=ids, process_group=group, find_unused_parameters=find_unused_parameters)
