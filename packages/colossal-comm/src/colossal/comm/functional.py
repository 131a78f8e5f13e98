"""Differentiable collectives for parallel layers (autograd functions with the right backward).

=========================== ============================ =============================
function                    forward                      backward
=========================== ============================ =============================
``copy_to_group``           identity                     all-reduce (sum)
``reduce_from_group``       all-reduce (sum)             identity
``split_along_dim``         keep this rank's slice       all-gather along ``dim``
``gather_along_dim``        all-gather along ``dim``     keep this rank's slice
``all_gather_along_dim``    all-gather along ``dim``     reduce-scatter along ``dim``
``reduce_scatter_along_dim``reduce-scatter along ``dim`` all-gather along ``dim``
``all_to_all_along_dims``   all-to-all (scatter ``s``,   all-to-all (scatter ``g``,
                            gather ``g``)                gather ``s``)
=========================== ============================ =============================

``copy_to_group``/``reduce_from_group`` are Megatron's *f*/*g*; ``gather_along_dim`` is for a
replicated consumer of a split tensor (each rank's gradient is already complete), while
``all_gather_along_dim`` is for a consumer whose gradient is a partial sum per rank (sequence
parallel), hence the reduce-scatter in its backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.comm import collectives as C

__all__ = [
    "copy_to_group",
    "reduce_from_group",
    "split_along_dim",
    "gather_along_dim",
    "all_gather_along_dim",
    "reduce_scatter_along_dim",
    "all_to_all_along_dims",
]


def _local_slice(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"size {tuple(x.shape)} along dim {dim} must be divisible by the group size {n}")
    return x.chunk(n, dim=dim)[r].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), group=ctx.group, tag="functional.copy_to_group"), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(
            x.clone(memory_format=torch.contiguous_format), group=group, tag="functional.reduce_from_group"
        )

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _local_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad.contiguous(), group=ctx.group, dim=ctx.dim, tag="functional.split"), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.all_gather(x, group=group, dim=dim, tag="functional.gather")

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, ctx.dim, ctx.group), None, None


class _AllGatherRS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.all_gather(x, group=group, dim=dim, tag="functional.all_gather")

    @staticmethod
    def backward(ctx, grad):
        return C.reduce_scatter(grad, group=ctx.group, dim=ctx.dim, tag="functional.all_gather.bwd"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return C.reduce_scatter(x, group=group, dim=dim, tag="functional.reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, group=ctx.group, dim=ctx.dim, tag="functional.reduce_scatter.bwd"), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return C.all_to_all_dims(x, scatter_dim, gather_dim, group=group, tag="functional.all_to_all")

    @staticmethod
    def backward(ctx, grad):
        s, g = ctx.dims
        return C.all_to_all_dims(grad, g, s, group=ctx.group, tag="functional.all_to_all.bwd"), None, None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group``."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward."""
    return _ReduceFromGroup.apply(x, group)


def split_along_dim(x: torch.Tensor, dim: int = -1, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's ``1/n`` slice along ``dim``; backward all-gathers the gradient."""
    return _Split.apply(x, _dim(x, dim), group)


def gather_along_dim(x: torch.Tensor, dim: int = -1, group: ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's slice of the (complete) gradient."""
    return _Gather.apply(x, _dim(x, dim), group)


def all_gather_along_dim(x: torch.Tensor, dim: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters the (partial) gradient."""
    return _AllGatherRS.apply(x, _dim(x, dim), group)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """Reduce-scatter along ``dim``; backward all-gathers the gradient."""
    return _ReduceScatter.apply(x, _dim(x, dim), group)


def all_to_all_along_dims(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Split along ``scatter_dim`` across ranks and concatenate along ``gather_dim``; the
    backward does the reverse switch."""
    return _AllToAll.apply(x, _dim(x, scatter_dim), _dim(x, gather_dim), group)
