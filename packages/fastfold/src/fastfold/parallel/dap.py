"""Dynamic axial parallelism (FastFold, Cheng et al. 2022, section 3).

[Note: DAP layouts]
Inside the trunk each rank of the DAP group holds a ``1/n`` slice of one axis:

* the MSA representation ``m`` [*, S, R, c_m] is split along sequences (``S``, dim -3) for row
  attention, and along residues (``R``, dim -2) for column attention, the transition and the outer
  product mean;
* the pair representation ``z`` [*, R, R, c_z] is split along rows (dim -3) for the outgoing
  triangle update and starting-node attention, and along columns (dim -2) for the incoming update,
  ending-node attention and the transition.

An all-to-all switches the split axis; operands an operator needs whole (the pair bias of
attention, the right projection of the outer product mean and of the outgoing triangle update, the
left one of the incoming update) are all-gathered, whose backward is a reduce-scatter because each
rank's gradient for them is a partial sum. Parameters are replicated: every rank's parameter
gradient is its share of the sum, so :func:`reduce_gradients` sums them over the group.

[Note: overlapping collectives with compute]
``gather_async``/``all_to_all_async`` start the collective and return an :class:`AsyncTensor`;
``wait()`` later yields the result. Autograd sees two nodes, start and wait, linked by an empty
token: the wait's backward *starts* the backward collective of the gradient and the start's
backward *waits* for it, so backward overlaps the same way forward does (compute scheduled between
the two nodes runs while the bytes move).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal import comm as C

__all__ = ["Dap", "AsyncTensor", "reduce_gradients", "pad_axis"]


class _Pending:
    """Handles of one in-flight collective pair (forward, then backward)."""

    def __init__(self, fwd, bwd):
        self.fwd_issue, self.bwd_issue = fwd, bwd
        self.fwd_handle = None
        self.bwd_handle = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        pending.fwd_handle = pending.fwd_issue(x.contiguous())
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        return ctx.pending.bwd_handle.wait(), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, pending):
        ctx.pending = pending
        return pending.fwd_handle.wait()

    @staticmethod
    def backward(ctx, grad):
        ctx.pending.bwd_handle = ctx.pending.bwd_issue(grad.contiguous())
        return grad.new_empty(0), None


class AsyncTensor:
    """A tensor whose collective is in flight; :meth:`wait` returns it (differentiably)."""

    def __init__(self, x: torch.Tensor, fwd, bwd):
        self._pending = _Pending(fwd, bwd)
        self._token = _Start.apply(x, self._pending)

    def wait(self) -> torch.Tensor:
        """Block until the collective is done and return its result."""
        return _Wait.apply(self._token, self._pending)


def pad_axis(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``x`` at the end of axis ``dim`` up to ``size``."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, extra]
    return F.pad(x, pad)


class Dap:
    """The DAP group and the collectives that switch the split axis (see [Note: DAP layouts])."""

    def __init__(self, group: ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Dap needs torch.distributed to be initialised (see colossal.comm.launch)")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def padded(self, n: int) -> int:
        """``n`` rounded up to a multiple of the DAP size."""
        return -(-n // self.size) * self.size

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a replicated tensor (no communication, no gradient path to peers)."""
        return x.chunk(self.size, dim=dim)[self.rank]

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Enter the DAP region: this rank's slice; the backward all-gathers the gradient."""
        return C.split_along_dim(x, dim, self.group)

    def gather_output(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Leave the DAP region: all-gather; the backward keeps this rank's slice."""
        return C.gather_along_dim(x, dim, self.group)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather an operand used whole inside the region; the backward reduce-scatters."""
        return C.all_gather_along_dim(x.contiguous(), dim, self.group)

    def gather_async(self, x: torch.Tensor, dim: int) -> AsyncTensor:
        """:meth:`gather` started now, finished by ``.wait()``."""
        g = self.group
        fwd = lambda t: C.all_gather(t, g, dim=dim, async_op=True, tag="fastfold.dap.gather")
        bwd = lambda t: C.reduce_scatter(t, group=g, dim=dim, async_op=True, tag="fastfold.dap.gather.bwd")
        return AsyncTensor(x, fwd, bwd)

    def gather_nograd(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather of a tensor outside autograd (masks)."""
        return C.all_gather(x.contiguous(), self.group, dim=dim, tag="fastfold.dap.gather_mask")

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Switch the split axis from ``gather_dim`` to ``scatter_dim`` (differentiable)."""
        return C.all_to_all_along_dims(x.contiguous(), scatter_dim, gather_dim, self.group)

    def all_to_all_async(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> AsyncTensor:
        """:meth:`all_to_all` started now, finished by ``.wait()``."""
        g, s, d = self.group, scatter_dim, gather_dim
        fwd = lambda t: C.all_to_all_dims(t, s, d, group=g, async_op=True, tag="fastfold.dap.all_to_all")
        bwd = lambda t: C.all_to_all_dims(t, d, s, group=g, async_op=True, tag="fastfold.dap.all_to_all.bwd")
        return AsyncTensor(x, fwd, bwd)


def reduce_gradients(module: nn.Module, dap: Dap) -> None:
    """Sum every parameter gradient of ``module`` over the DAP group (call after ``backward``)."""
    with torch.profiler.record_function("fastfold.dap::reduce_gradients"):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        C.all_reduce(flat, group=dap.group, tag="fastfold.dap.reduce_gradients")
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
