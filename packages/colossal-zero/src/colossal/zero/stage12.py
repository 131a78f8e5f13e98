"""Stages 1 and 2: parameters stay replicated as views into flat buckets; after each step every
rank's updated fp32 shard is cast and all-gathered back into the buckets."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm import all_gather
from colossal.zero._flat_param import FlatParam

__all__ = ["build_buckets", "gather_updated_params", "start_gather_updated_params"]


def build_buckets(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], bucket_numel: int, world: int, rank: int
) -> list[FlatParam]:
    """Split each optimizer param group into flat buckets of at most ``bucket_numel`` elements.

    Parameters are taken in reverse registration order, the usual order in which backward
    produces their gradients, so the first bucket completes (and communicates) first. Frozen
    parameters (``requires_grad=False``) are left out even when the optimizer lists them.
    """
    flats: list[FlatParam] = []
    for gi, group in enumerate(optimizer.param_groups):
        bucket: list[nn.Parameter] = []
        for p in reversed(list(group["params"])):
            if not p.requires_grad:  # no master, no gather: kept whole, like a buffer ([Note: frozen parameters])
                continue
            if bucket and sum(q.numel() for q in bucket) + p.numel() > bucket_numel:
                flats.append(FlatParam(bucket, [names[q] for q in bucket], gi, world, rank))
                bucket = []
            bucket.append(p)
        if bucket:
            flats.append(FlatParam(bucket, [names[q] for q in bucket], gi, world, rank))
    return flats


def start_gather_updated_params(flats: list[FlatParam], group: ProcessGroup | None) -> list[tuple[FlatParam, object]]:
    """Start all-gathering each bucket's updated master shard into its (working-dtype) full buffer;
    returns ``(bucket, handle)`` pairs. Each lands straight in the bucket's storage (with fp32
    parameters and no offload the source is the bucket's own slice: the in-place all-gather).
    Buckets hold parameters in reverse registration order, so the last bucket (the first layers)
    is issued first: the next forward needs it first.
    """
    with torch.profiler.record_function("colossal.zero::all_gather_params"):
        handles = []
        for flat in reversed(flats):
            src = flat.master.to(device=flat.full.device, dtype=flat.full.dtype)  # (shard_numel,)
            handles.append((flat, all_gather(src, group, async_op=True, tag="zero.all_gather_params", out=flat.full)))
        return handles


def gather_updated_params(flats: list[FlatParam], group: ProcessGroup | None) -> None:
    """All gathers of :func:`start_gather_updated_params`, issued together, then waited."""
    for _, handle in start_gather_updated_params(flats, group):
        handle.wait()
