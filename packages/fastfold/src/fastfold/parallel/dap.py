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
the two nodes runs while the bytes move). ``Dap(overlap=False)`` issues the same collectives
synchronously at the start node (same layouts and results; for debugging and for measuring the
overlap).

[Note: overlapping the pair all-to-alls]
An Evoformer block switches the pair layout four times (rows -> columns and back, twice). FastFold's
"duality async" idea is applied in two ways (all differentiable, the backward mirrors the forward):

* the pair representation enters and leaves a block with its *columns* local; the block starts the
  columns -> rows all-to-all first and waits for it only when the outer product mean adds its
  (row-local) update, so the transfer overlaps the whole MSA stack. The row-attention bias is
  position-wise in ``z`` and gathered whole anyway, so it is computed from the column-local ``z``
  and gathered along columns;
* the three switches inside the pair stack are pipelined (:meth:`Dap.all_to_all_pipelined`): the
  tensor moves in ``pieces`` slices of the destination's local axis, all started at once; while
  slice ``k + 1`` is in flight the next operator's position-wise prologue (layer norm, projections,
  attention bias; its ``prepare`` method) runs on slice ``k``. The first slice is exposed, the rest
  is hidden behind that prologue.

Communication volume is unchanged; results are the same up to summation order (the prologue runs
on slices, which is exact for position-wise operations).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal import comm as C

__all__ = ["Dap", "AsyncTensor", "reduce_gradients", "pad_axis"]

_A2A_TAG = "fastfold.dap.all_to_all"
PAIR_A2A_TAG = "fastfold.dap.pair_all_to_all"
"""Tag of the pair representation's all-to-alls (forward; the backward appends ``.bwd``)."""


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
        grad = ctx.pending.bwd_handle.wait()
        ctx.pending.bwd_handle = None  # free the collective's buffers
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, pending):
        ctx.pending = pending
        out = pending.fwd_handle.wait()
        # The graph keeps ``pending`` until backward (also through checkpointed blocks, whose
        # nodes outlive their saved tensors): drop the handle, it holds the send/receive buffers.
        pending.fwd_handle = None
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.pending.bwd_handle = ctx.pending.bwd_issue(grad.contiguous())
        return grad.new_empty(0), None


class _Done:
    """A completed handle (the synchronous path of ``Dap(overlap=False)``)."""

    def __init__(self, result):
        self._result = result

    def wait(self):
        return self._result


def _issuer(issue, overlap: bool):
    """``issue(tensor, async_op)`` as a one-argument function returning a handle."""
    return (lambda t: issue(t, True)) if overlap else (lambda t: _Done(issue(t, False)))


class AsyncTensor:
    """A tensor whose collective is in flight; :meth:`wait` returns it (differentiably).
    ``fwd``/``bwd``: ``issue(tensor, async_op)`` of the forward and backward collectives;
    ``overlap=False`` runs them synchronously where they are issued."""

    def __init__(self, x: torch.Tensor, fwd, bwd, overlap: bool = True):
        self._pending = _Pending(_issuer(fwd, overlap), _issuer(bwd, overlap))
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
    """The DAP group and the collectives that switch the split axis (see [Note: DAP layouts]).
    ``overlap``: start collectives early and wait for them later (``False``: synchronous, same
    layouts and results); ``pieces``: slices of a pipelined all-to-all (see [Note: overlapping the
    pair all-to-alls])."""

    def __init__(self, group: ProcessGroup | None = None, *, overlap: bool = True, pieces: int = 2):
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
        if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
            raise ValueError(f"pieces must be a positive int, got {pieces!r}")
        if not dist.is_initialized():
            raise RuntimeError("Dap needs torch.distributed to be initialised (see colossal.comm.launch)")
        self.overlap, self.pieces = overlap, pieces
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
        fwd = lambda t, a: C.all_gather(t, g, dim=dim, async_op=a, tag="fastfold.dap.gather")
        bwd = lambda t, a: C.reduce_scatter(t, group=g, dim=dim, async_op=a, tag="fastfold.dap.gather.bwd")
        return AsyncTensor(x, fwd, bwd, self.overlap)

    def gather_nograd(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather of a tensor outside autograd (masks)."""
        return C.all_gather(x.contiguous(), self.group, dim=dim, tag="fastfold.dap.gather_mask")

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Switch the split axis from ``gather_dim`` to ``scatter_dim`` (differentiable)."""
        return C.all_to_all_along_dims(x.contiguous(), scatter_dim, gather_dim, self.group)

    def all_to_all_async(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, tag: str = _A2A_TAG) -> AsyncTensor:
        """:meth:`all_to_all` started now, finished by ``.wait()``."""
        g, s, d, t_bwd = self.group, scatter_dim, gather_dim, tag + ".bwd"
        fwd = lambda t, a: C.all_to_all_dims(t, s, d, group=g, async_op=a, tag=tag)
        bwd = lambda t, a: C.all_to_all_dims(t, d, s, group=g, async_op=a, tag=t_bwd)
        return AsyncTensor(x, fwd, bwd, self.overlap)

    def all_to_all_pipelined(self, x, scatter_dim, gather_dim, mask, prepare):
        """Switch ``x`` [*, A, B, c] from ``gather_dim`` to ``scatter_dim`` local (both in {-3, -2})
        in ``pieces`` slices, running ``prepare(x_piece, mask_piece)`` (position-wise, returns a
        tuple of [*, A, B, ...] tensors) on each slice as it arrives while the next ones move.
        ``mask`` [*, A, B] is already in the destination layout. Returns ``(x, prepare(x, mask))``
        in the destination layout (see [Note: overlapping the pair all-to-alls])."""
        pieces = self.pieces if self.overlap else 1
        local = x.shape[scatter_dim] // self.size
        bounds = [(i * local // pieces, (i + 1) * local // pieces) for i in range(pieces)]
        bounds = [(lo, hi - lo) for lo, hi in bounds if hi > lo]
        sd = scatter_dim
        xs = x.unflatten(sd, (self.size, local))  # the slices' positions in every destination's block
        if len(bounds) == 1:
            x = self.all_to_all_async(x, sd, gather_dim, PAIR_A2A_TAG).wait()
            return x, tuple(prepare(x, mask))
        handles = [
            self.all_to_all_async(xs.narrow(sd, lo, n).flatten(sd - 1, sd), sd, gather_dim, PAIR_A2A_TAG)
            for lo, n in bounds
        ]
        outs = None
        for (lo, n), handle in zip(bounds, handles):
            piece = handle.wait()
            parts = (piece, *prepare(piece, mask.narrow(sd + 1, lo, n)))
            outs = outs or [_empty_in_layout(p, p.shape[:sd] + (local,) + p.shape[sd + 1 :]) for p in parts]
            for out, part in zip(outs, parts):
                out.narrow(sd, lo, n).copy_(part)
        return outs[0], tuple(outs[1:])


def _empty_in_layout(like: torch.Tensor, shape) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` whose axes lie in memory in the order of ``like``'s
    strides (a channels-last view of channels-first storage stays so: no permuting copy)."""
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))  # outermost axis first
    buf = like.new_empty([shape[d] for d in order])
    return buf.permute([order.index(d) for d in range(like.dim())])


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
