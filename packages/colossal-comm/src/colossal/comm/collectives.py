"""Collectives with one consistent API, each reporting a :class:`~colossal.comm.events.CommEvent`.

Conventions shared by every function here:

* ``group`` is a ``ProcessGroup`` (``None`` = the default world group).
* Peers (``src``, ``dst``, ``peer``) are **group ranks**, not global ranks.
* ``async_op=False`` returns the result; ``async_op=True`` returns a :class:`CommHandle` whose
  ``wait()`` returns that same result (start and wait are separate calls).
* ``op`` is a reduction name (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``) or a
  ``torch.distributed.ReduceOp``.
* In-place ops (``all_reduce``, ``broadcast``, ``reduce``, ``recv``) return the tensor passed in;
  the others return new tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.comm import debug, events

__all__ = [
    "CommHandle",
    "P2POp",
    "all_reduce",
    "all_gather",
    "all_gather_list",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_dims",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "batch_p2p",
    "ring_exchange",
    "group_ranks",
]

# torch >= 2.13 renamed the flat-tensor forms; keep working on older releases too.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class CommHandle:
    """An issued operation; ``wait()`` blocks until it completes and returns its result."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any], report: Callable[[], None]):
        self._works = works
        self._finish = finish
        self._report = report
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        """Block until the operation completes; returns its result (idempotent)."""
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._done = True
            self._report()
            # Let go of the issue/finish closures: they hold the input buffers (a bucket of
            # gradients, a gathered unit), which must be freed when the caller drops them, not
            # when the handle or a reference cycle through it is collected.
            self._works, self._finish, self._report = (), None, None
        return self._result

    def is_completed(self) -> bool:
        """True once every underlying request has completed (does not run ``wait``)."""
        return self._done or all(w.is_completed() for w in self._works)


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _reduce_op(op: str | dist.ReduceOp) -> dist.ReduceOp:
    if isinstance(op, str):
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        return _REDUCE_OPS[op]
    return op


def _check_tensor(name: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")


def _global(group: ProcessGroup | None, group_rank: int, what: str) -> int:
    size = dist.get_world_size(group)
    if not 0 <= group_rank < size:
        raise ValueError(f"{what}={group_rank} is not a rank of a group of size {size}")
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _issue(
    name: str,
    group: ProcessGroup | None,
    tensor: torch.Tensor,
    nbytes: int,
    async_op: bool,
    tag: str,
    issue: Callable[[], Any],
    finish: Callable[[], Any],
    ranks: tuple[int, ...] | None = None,
    detail: tuple = (),
    debug_shape: list | None = None,
) -> Any:
    """Issue one operation (always asynchronously underneath), then wait or hand back a handle.

    ``detail`` (raw ``(name, value)`` pairs, formatted only in debug mode) and ``debug_shape``
    (default: ``tensor``'s shape) are what debug mode compares across ranks besides the op, dtype
    and group (``colossal.comm.debug``).
    """
    if debug.ENABLED:
        debug.check_collective(name, group, tensor, detail, debug_shape)
    observing = events.has_observers()
    start = time.perf_counter() if observing else 0.0
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"colossal.comm::{name}"):
            works = issue()
    else:
        works = issue()
    works = [w for w in (works if isinstance(works, list) else [works]) if w is not None]

    def report() -> None:
        if observing and events.has_observers():
            events.emit(
                events.CommEvent(
                    op=name,
                    group_size=dist.get_world_size(group),
                    ranks=ranks if ranks is not None else group_ranks(group),
                    nbytes=nbytes,
                    dtype=tensor.dtype,
                    async_op=async_op,
                    start=start,
                    end=time.perf_counter(),
                    tag=tag,
                )
            )

    handle = CommHandle(works, finish, report)
    return handle if async_op else handle.wait()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Any:
    """Reduce ``tensor`` across the group, in place; returns ``tensor``."""
    _check_tensor("tensor", tensor)
    rop = _reduce_op(op)
    return _issue(
        "all_reduce",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.all_reduce(tensor, op=rop, group=group, async_op=True),
        lambda: tensor,
        detail=(("op", op),),
    )


def _check_out(out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """``out`` if it can receive ``shape`` elements of ``like``'s kind, else a new buffer."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check_tensor("out", out)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(
            f"{what}: out must be a contiguous {like.dtype} tensor of shape {shape} on {like.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
    return out


# [Note: gloo fast paths]
# On CPU tensors gloo's flat all-gather and reduce-scatter are slower than what they can be built
# from. Measured on the 2-core development machine (2 ranks, 46M fp32 elements; 4 ranks, 16M):
# all_gather_into_tensor 0.18 / 0.10 s against one broadcast per rank 0.08 / 0.05 s, and
# reduce_scatter_tensor 0.22 / 0.15 s against an in-place all_reduce plus a slice copy 0.16 /
# 0.10 s. So for gloo, ``all_gather`` issues one broadcast per rank into the output's slices, and
# ``reduce_scatter(..., destroy_input=True)`` (the caller gives up the input) all-reduces the input
# in place and copies out this rank's slice. Comm events still report the logical collective and
# its message size, so volume accounting is unchanged.


def _is_gloo(group: ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """This group runs collectives on ``tensor`` with gloo (a CPU tensor on a gloo-capable group)."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group)).lower()


def _gather_stacked(
    tensor: torch.Tensor, group: ProcessGroup | None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, Callable]:
    """Return a ``(n, *shape)`` view of the output buffer and the issuing callable."""
    n = dist.get_world_size(group)
    src = tensor.contiguous().view(-1) if tensor.dim() == 0 else tensor.contiguous()
    flat = _check_out(out, src, (n * src.shape[0], *src.shape[1:]), "all_gather")
    if not _is_gloo(group, src):
        return flat.view(n, *tensor.shape), lambda: _all_gather_flat(flat, src, group=group, async_op=True)
    rows = flat.view(n, -1)  # (n, numel) one contiguous row per rank

    def issue() -> list:  # see [Note: gloo fast paths]
        rows[dist.get_rank(group)].copy_(src.view(-1))
        return [dist.broadcast(rows[i], _global(group, i, "src"), group=group, async_op=True) for i in range(n)]

    return flat.view(n, *tensor.shape), issue


def all_gather(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    dim: int = 0,
    async_op: bool = False,
    tag: str = "",
    out: torch.Tensor | None = None,
) -> Any:
    """Concatenate every rank's ``tensor`` along ``dim`` (in group-rank order).

    Returns a new tensor, or ``out`` when given (``dim=0`` only: a contiguous tensor of shape
    ``(n * tensor.shape[0], *tensor.shape[1:])``), so callers can gather straight into storage
    they own.
    """
    _check_tensor("tensor", tensor)
    dim = _check_dim(tensor, dim)
    if out is not None and dim != 0:
        raise NotImplementedError(f"all_gather(out=...) supports dim=0 only, got dim={dim}")
    n = dist.get_world_size(group)
    stacked, issue = _gather_stacked(tensor, group, out)

    def finish() -> torch.Tensor:
        if out is not None:
            return out
        if dim == 0:
            return stacked.reshape(n * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else stacked
        return torch.cat(stacked.unbind(0), dim=dim)

    detail = (("dim", dim),)
    return _issue("all_gather", group, tensor, n * _nbytes(tensor), async_op, tag, issue, finish, detail=detail)


def all_gather_list(
    tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False, tag: str = ""
) -> Any:
    """Every rank's ``tensor`` as a list indexed by group rank (views of one buffer)."""
    _check_tensor("tensor", tensor)
    n = dist.get_world_size(group)
    out, issue = _gather_stacked(tensor, group)
    return _issue("all_gather", group, tensor, n * _nbytes(tensor), async_op, tag, issue, lambda: list(out.unbind(0)))


def _check_dim(tensor: torch.Tensor, dim: int) -> int:
    nd = max(tensor.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % nd


def _check_divisible(tensor: torch.Tensor, dim: int, n: int, what: str) -> None:
    if tensor.dim() == 0 or tensor.shape[dim] % n:
        raise ValueError(f"{what}: size {tuple(tensor.shape)} along dim {dim} must be divisible by the group size {n}")


def reduce_scatter(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: ProcessGroup | None = None,
    dim: int = 0,
    async_op: bool = False,
    tag: str = "",
    out: torch.Tensor | None = None,
    destroy_input: bool = False,
) -> Any:
    """Reduce ``tensor`` across the group and keep this rank's ``1/n`` slice along ``dim``.

    Returns a new tensor, or ``out`` when given (``dim=0`` only: a contiguous tensor of shape
    ``(tensor.shape[0] // n, *tensor.shape[1:])``). ``destroy_input=True`` says the caller no
    longer needs ``tensor``'s contents, which lets gloo run a faster in-place all-reduce (see
    ``[Note: gloo fast paths]``); ``tensor`` is undefined afterwards.
    """
    _check_tensor("tensor", tensor)
    dim = _check_dim(tensor, dim)
    if out is not None and dim != 0:
        raise NotImplementedError(f"reduce_scatter(out=...) supports dim=0 only, got dim={dim}")
    n = dist.get_world_size(group)
    _check_divisible(tensor, dim, n, "reduce_scatter")
    rop = _reduce_op(op)
    src = tensor.movedim(dim, 0).contiguous()
    out = _check_out(out, src, (src.shape[0] // n, *src.shape[1:]), "reduce_scatter")
    issue = lambda: _reduce_scatter_flat(out, src, op=rop, group=group, async_op=True)  # noqa: E731
    finish = lambda: out if dim == 0 else out.movedim(0, dim)  # noqa: E731
    if destroy_input and rop != dist.ReduceOp.AVG and _is_gloo(group, src):  # [Note: gloo fast paths]
        mine = src.narrow(0, dist.get_rank(group) * out.shape[0], out.shape[0])
        issue = lambda: dist.all_reduce(src, op=rop, group=group, async_op=True)  # noqa: E731
        finish = lambda: out.copy_(mine) if dim == 0 else out.copy_(mine).movedim(0, dim)  # noqa: E731
    detail = (("op", op), ("dim", dim))
    return _issue("reduce_scatter", group, tensor, _nbytes(tensor), async_op, tag, issue, finish, detail=detail)


def all_to_all(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Any:
    """Send slice ``i`` (along dim 0) of ``tensor`` to rank ``i``; return the received slices
    concatenated in rank order. Split sizes default to even splits; give both for uneven ones."""
    _check_tensor("tensor", tensor)
    n = dist.get_world_size(group)
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("give both output_split_sizes and input_split_sizes, or neither")
    if input_split_sizes is None:
        _check_divisible(tensor, 0, n, "all_to_all")
        rows = tensor.shape[0]
    else:
        for name, sizes in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
            if len(sizes) != n or any(s < 0 for s in sizes):
                raise ValueError(f"{name} must be {n} non-negative sizes, got {list(sizes)}")
        if sum(input_split_sizes) != tensor.shape[0]:
            raise ValueError(
                f"input_split_sizes {list(input_split_sizes)} sum to {sum(input_split_sizes)}, "
                f"but the tensor has {tensor.shape[0]} rows"
            )
        rows = sum(output_split_sizes)
    src = tensor.contiguous()
    out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=src.device)
    outs, ins = (list(output_split_sizes), list(input_split_sizes)) if input_split_sizes is not None else (None, None)
    return _issue(
        "all_to_all",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.all_to_all_single(out, src, outs, ins, group=group, async_op=True),
        lambda: out,
        debug_shape=None if ins is None else ["*", *src.shape[1:]],  # uneven splits: rows may differ
    )


def all_to_all_dims(
    tensor: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Any:
    """Split ``tensor`` into ``n`` chunks along ``scatter_dim``, send chunk ``i`` to rank ``i``
    and concatenate what arrives along ``gather_dim`` (the Ulysses / DAP axis switch)."""
    _check_tensor("tensor", tensor)
    scatter_dim, gather_dim = _check_dim(tensor, scatter_dim), _check_dim(tensor, gather_dim)
    n = dist.get_world_size(group)
    _check_divisible(tensor, scatter_dim, n, "all_to_all_dims")
    src = torch.stack(tensor.chunk(n, dim=scatter_dim))  # (n, *chunk_shape)
    out = torch.empty_like(src)
    return _issue(
        "all_to_all",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.all_to_all_single(out, src, group=group, async_op=True),
        lambda: torch.cat(out.unbind(0), dim=gather_dim),
        detail=(("scatter_dim", scatter_dim), ("gather_dim", gather_dim)),
    )


def broadcast(
    tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False, tag: str = ""
) -> Any:
    """Copy group rank ``src``'s ``tensor`` into every rank's ``tensor``, in place."""
    _check_tensor("tensor", tensor)
    gsrc = _global(group, src, "src")
    return _issue(
        "broadcast",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.broadcast(tensor, gsrc, group=group, async_op=True),
        lambda: tensor,
        detail=(("src", src),),
    )


def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: str | dist.ReduceOp = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Any:
    """Reduce ``tensor`` onto group rank ``dst`` (in place there; other ranks' values undefined)."""
    _check_tensor("tensor", tensor)
    gdst, rop = _global(group, dst, "dst"), _reduce_op(op)
    return _issue(
        "reduce",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.reduce(tensor, gdst, op=rop, group=group, async_op=True),
        lambda: tensor,
        detail=(("op", op), ("dst", dst)),
    )


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, async_op: bool = False, tag: str = ""):
    """Send ``tensor`` to group rank ``dst``; returns ``tensor``."""
    _check_tensor("tensor", tensor)
    gdst = _global(group, dst, "dst")
    src = tensor.contiguous()
    return _issue(
        "send",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.isend(src, gdst, group=group),
        lambda: tensor,
        ranks=(dist.get_rank(), gdst),
    )


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False, tag: str = ""):
    """Receive into ``tensor`` (contiguous) from group rank ``src``; returns ``tensor``."""
    _check_tensor("tensor", tensor)
    if not tensor.is_contiguous():
        raise ValueError("recv needs a contiguous tensor to receive into")
    gsrc = _global(group, src, "src")
    return _issue(
        "recv",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.irecv(tensor, gsrc, group=group),
        lambda: tensor,
        ranks=(dist.get_rank(), gsrc),
    )


class P2POp(NamedTuple):
    """One half of a batched point-to-point exchange: ``kind`` is ``"send"`` or ``"recv"``."""

    kind: str
    tensor: torch.Tensor
    peer: int
    """Group rank of the other side."""
    group: ProcessGroup | None = None


def batch_p2p(ops: Sequence[P2POp], async_op: bool = False, tag: str = "") -> Any:
    """Issue many sends and receives together (deadlock-free in any order); returns the list of
    tensors (received ones filled)."""
    if not ops:
        raise ValueError("batch_p2p needs at least one operation")
    torch_ops = []
    for p in ops:
        if p.kind not in ("send", "recv"):
            raise ValueError(f"P2POp.kind must be 'send' or 'recv', got {p.kind!r}")
        _check_tensor("P2POp.tensor", p.tensor)
        fn = dist.isend if p.kind == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, p.tensor, _global(p.group, p.peer, "peer"), p.group))
    nbytes = sum(_nbytes(p.tensor) for p in ops if p.kind == "send")
    return _issue(
        "batch_p2p",
        ops[0].group,
        ops[0].tensor,
        nbytes,
        async_op,
        tag,
        lambda: dist.batch_isend_irecv(torch_ops),
        lambda: [p.tensor for p in ops],
    )


def ring_exchange(
    tensor: torch.Tensor, group: ProcessGroup | None = None, shift: int = 1, async_op: bool = False, tag: str = ""
) -> Any:
    """Send ``tensor`` to group rank ``r + shift`` and return what rank ``r - shift`` sent
    (modulo the group size): one step of a ring pass."""
    _check_tensor("tensor", tensor)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    src, out = tensor.contiguous(), torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if n == 1:
        out.copy_(src)
        return _issue("ring_exchange", group, tensor, _nbytes(tensor), async_op, tag, lambda: [], lambda: out)
    ops = [
        dist.P2POp(dist.isend, src, _global(group, (r + shift) % n, "peer"), group),
        dist.P2POp(dist.irecv, out, _global(group, (r - shift) % n, "peer"), group),
    ]
    return _issue(
        "ring_exchange",
        group,
        tensor,
        _nbytes(tensor),
        async_op,
        tag,
        lambda: dist.batch_isend_irecv(ops),
        lambda: out,
        detail=(("shift", shift),),
    )
