"""Gradient norms and clipping over gradients sharded across a process group.

[Note: sharded norms]
Each rank holds some shards (``sharded``: disjoint pieces, each element on exactly one rank) and
possibly some tensors that every rank holds identically (``replicated``). For a p-norm the total
is ``(sum_over_ranks(sum |shard|^p) + sum |replicated|^p) ** (1/p)``: the sharded part is
all-reduced (one SUM of one fp32 scalar), the replicated part is added locally *after* the
reduction so it is counted once. For the inf-norm the sharded maximum is all-reduced with MAX; a
NaN flag travels along in the same all-reduce because MAX reductions may drop NaNs. Per-tensor
norms come from ``torch._foreach_norm`` (one multi-tensor kernel per device and dtype) in fp32.
Nothing here synchronises with the host: results stay tensors.

Every function that communicates takes ``all_reduce=``: the engines pass
``colossal.comm.all_reduce`` so the reduction is a comm event like the rest of their traffic
(this package depends on torch alone, so it cannot call ``colossal.comm`` itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ._dist import AllReduce, active_group, check_all_reduce, comm_device
from ._dist import all_reduce as _reduce

__all__ = ["has_inf_or_nan", "grad_norm", "clip_grad_norm_", "group_norm_reducer"]


def _as_list(tensors: Iterable[Tensor] | Tensor, name: str) -> list[Tensor]:
    tensors = [tensors] if isinstance(tensors, Tensor) else [t for t in tensors if t is not None]
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must hold tensors, got {type(t).__name__}")
        if t.is_sparse:
            raise TypeError(f"{name}: sparse tensors are not supported (got layout {t.layout}); densify them")
    return tensors


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p == math.inf or (math.isfinite(p) and p > 0)):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def _grouped(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """Non-empty tensors by (device, dtype): one multi-tensor kernel each (empty ones add nothing)."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _local_norms(tensors: list[Tensor], p: float, device: torch.device) -> Tensor:
    """fp32 per-tensor p-norms of ``tensors`` (any devices/dtypes), concatenated on ``device``."""
    parts = [torch.zeros(0, dtype=torch.float32, device=device)]
    for (_, dtype), ts in _grouped(tensors).items():
        # fp16/bf16 accumulate in fp32 (no overflow of the norm itself); fp64 is computed natively.
        widen = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        norms = torch.stack(torch._foreach_norm(ts, p, dtype=widen))
        parts.append(norms.to(device, torch.float32, non_blocking=True))
    return torch.cat(parts)


def _reduce_pnorm(norms: Tensor, p: float) -> Tensor:
    return norms.pow(p).sum() if p != 1.0 else norms.sum()


def _reduce_inf(norms: Tensor) -> Tensor:
    """``[max, nan_flag]`` of per-tensor inf-norms (max of an empty set is 0)."""
    nan_flag = norms.isnan().any().to(torch.float32)
    peak = norms.nan_to_num(nan=0.0, posinf=math.inf).amax() if norms.numel() else norms.new_zeros(())
    return torch.stack([peak, nan_flag])


def _non_finite(ts: list[Tensor]) -> Tensor:
    """Whether any of ``ts`` (one device and dtype) holds an inf or NaN, as a bool tensor.

    An inf or NaN element makes its tensor's sum inf or NaN, so finite sums prove every element finite;
    sums are one fast reduction each (the inf-norm is several times slower on CPU). Only when a sum is
    not finite (an overflow, or finite elements whose sum overflows) are the elements checked.
    """
    sums = torch.stack([t.sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None) for t in ts])
    if bool(sums.isfinite().all()):
        return torch.zeros((), dtype=torch.bool, device=sums.device)
    return (~torch.stack(torch._foreach_norm(ts, math.inf)).isfinite()).any()


def has_inf_or_nan(
    tensors: Iterable[Tensor], group: ProcessGroup | None = None, *, all_reduce: AllReduce | None = None
) -> bool:
    """True on every rank of ``group`` if any rank's ``tensors`` hold an inf or NaN.

    One all-reduce (MAX) of a one-element flag, with ``all_reduce`` (default
    ``torch.distributed.all_reduce``); ``group=None`` means the default group when
    torch.distributed is initialised, else this process alone. Synchronises with the host.
    """
    check_all_reduce(all_reduce)
    tensors = _as_list(tensors, "tensors")
    group = active_group(group)
    fallback = tensors[0].device if tensors else torch.device("cpu")
    device = comm_device(group, fallback)
    with torch.profiler.record_function("colossal.optim::has_inf_or_nan"), torch.no_grad():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for ts in _grouped(tensors).values():
            flag = torch.maximum(flag, _non_finite(ts).to(device, torch.float32))
        _reduce(flag, dist.ReduceOp.MAX, group, all_reduce)
    return bool(flag.item())


def grad_norm(
    sharded: Iterable[Tensor],
    norm_type: float = 2.0,
    group: ProcessGroup | None = None,
    replicated: Iterable[Tensor] = (),
    *,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """The ``norm_type``-norm of all ranks' ``sharded`` tensors plus ``replicated`` counted once.

    See ``[Note: sharded norms]``. Returns an fp32 scalar, equal on every rank of ``group``, on
    the device the group communicates from (CPU for gloo); inf/NaN propagate. ``group=None``
    means the default group when torch.distributed is initialised. ``all_reduce``: the in-place
    reduction to use (default ``torch.distributed.all_reduce``).
    """
    check_all_reduce(all_reduce)
    p = _check_norm_type(norm_type)
    sharded, replicated = _as_list(sharded, "sharded"), _as_list(replicated, "replicated")
    group = active_group(group)
    fallback = (sharded + replicated)[0].device if sharded or replicated else torch.device("cpu")
    device = comm_device(group, fallback)
    with torch.profiler.record_function("colossal.optim::grad_norm"), torch.no_grad():
        shard_norms, rep_norms = _local_norms(sharded, p, device), _local_norms(replicated, p, device)
        if p == math.inf:
            acc = _reduce(_reduce_inf(shard_norms), dist.ReduceOp.MAX, group, all_reduce)
            rep = _reduce_inf(rep_norms)
            total = torch.maximum(acc[0], rep[0])
            return torch.where((acc[1] + rep[1]) > 0, torch.full_like(total, math.nan), total)
        acc = _reduce(_reduce_pnorm(shard_norms, p), dist.ReduceOp.SUM, group, all_reduce)
        total = acc + _reduce_pnorm(rep_norms, p)
        return total.sqrt() if p == 2.0 else (total if p == 1.0 else total.pow(1.0 / p))


def clip_grad_norm_(
    sharded: Iterable[Tensor] | Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    group: ProcessGroup | None = None,
    replicated: Iterable[Tensor] | Tensor = (),
    error_if_nonfinite: bool = False,
    *,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """Clip gradients spread across ``group`` to a global norm, like ``torch.nn.utils.clip_grad_norm_``.

    Computes :func:`grad_norm` of ``sharded`` and ``replicated`` (gradient tensors, not
    parameters) and multiplies them all in place by ``min(1, max_norm / (total + 1e-6))``.
    Returns the total norm. With a non-finite total the tensors become non-finite too (exactly as
    torch does): the caller must skip the step, or pass ``error_if_nonfinite=True`` to raise.
    ``all_reduce``: as for :func:`grad_norm`.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    sharded, replicated = _as_list(sharded, "sharded"), _as_list(replicated, "replicated")
    total = grad_norm(sharded, norm_type, group, replicated, all_reduce=all_reduce)
    if error_if_nonfinite and not bool(total.isfinite()):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients is non-finite ({total.item()}); "
            "set error_if_nonfinite=False to clip anyway"
        )
    with torch.profiler.record_function("colossal.optim::clip"), torch.no_grad():
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for (dev, _), ts in _grouped(sharded + replicated).items():
            torch._foreach_mul_(ts, coef.to(dev))
    return total


def group_norm_reducer(
    group: ProcessGroup | None, *, all_reduce: AllReduce | None = None
) -> Callable[[Tensor], Tensor]:
    """Build the ``norm_reducer`` for LAMB/LARS whose parameters are sharded over ``group``.

    The returned function takes a 1-D fp32 tensor of this rank's per-parameter squared norms
    (over the shards it holds; the same parameter order on every rank) and returns the
    whole-parameter squared norms: their sum over ``group`` (one all-reduce with
    ``all_reduce``, default ``torch.distributed.all_reduce``).
    """
    check_all_reduce(all_reduce)
    resolved = active_group(group)

    def reduce(sq_norms: Tensor) -> Tensor:
        if resolved is None:
            return sq_norms
        with torch.profiler.record_function("colossal.optim::norm_reduce"):
            buf = sq_norms.to(comm_device(resolved, sq_norms.device), torch.float32, copy=True)
            _reduce(buf, dist.ReduceOp.SUM, resolved, all_reduce)
            return buf.to(sq_norms.device)

    return reduce
