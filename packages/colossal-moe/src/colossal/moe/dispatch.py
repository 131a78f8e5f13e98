"""Token permutation (sort by expert and back) and the differentiable uneven all-to-all.

[Note: expert-parallel dispatch]
With ``ep`` ranks each holding ``E_local = E / ep`` consecutive experts (rank ``r`` holds
``r * E_local .. (r + 1) * E_local - 1``), one layer's forward is:

1. sort this rank's kept assignments by global expert: row block ``e`` goes to expert ``e``,
   and block ``r`` of ``E_local`` experts goes to rank ``r``;
2. exchange the counts (an even all-to-all of ``E`` int64 per rank), so every rank knows how
   many rows each peer sends it for each of its experts;
3. all-to-all the rows with uneven splits (``dispatch``); what arrives is ordered by source rank,
   then local expert, so a stable sort by local expert makes each expert's rows contiguous;
4. run the experts as grouped matmuls, undo the sort, all-to-all back (``combine``, the splits
   swapped), and scatter-add each row times its router weight into its token.

Both all-to-alls are autograd functions whose backward is the reverse all-to-all. Bytes per
layer and rank (``b`` bytes per element, ``S`` rows sent, ``R`` rows received):
forward ``8 E`` (counts) ``+ S C b`` (dispatch) ``+ R C b`` (combine); backward the same two
row exchanges again, ``R C b + S C b``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

import colossal.comm as cc

__all__ = ["all_to_all_uneven", "exchange_counts", "run_experts_parallel", "sort_by_expert"]


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, tag):
        ctx.splits, ctx.group, ctx.tag = (send_splits, recv_splits), group, tag
        return cc.all_to_all(x, group=group, output_split_sizes=recv_splits, input_split_sizes=send_splits, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        tag = ctx.tag + ".backward"
        g = grad.contiguous()
        out = cc.all_to_all(g, group=ctx.group, output_split_sizes=send, input_split_sizes=recv, tag=tag)
        return out, None, None, None, None


def all_to_all_uneven(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup | None, tag: str = ""
) -> torch.Tensor:
    """Send rows ``send_splits[i]`` of ``x`` (in order) to group rank ``i``; receive
    ``recv_splits[i]`` rows from rank ``i``. Differentiable: backward is the reverse exchange."""
    return _AllToAllUneven.apply(x, list(send_splits), list(recv_splits), group, tag)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``counts`` (E,) rows this rank sends per global expert -> (ep, E_local) rows each peer
    sends to each of this rank's experts (one even all-to-all of int64)."""
    ep = dist.get_world_size(group)
    received = cc.all_to_all(counts.to(torch.int64).contiguous(), group=group, tag="moe.counts")
    return received.view(ep, counts.numel() // ep)


def sort_by_expert(expert: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert`` (M,) expert per row -> (order (M,), counts (num_experts,)) so that
    ``rows[order]`` is grouped by ascending expert, keeping the original order within a group."""
    order = torch.argsort(expert, stable=True)
    return order, torch.bincount(expert, minlength=num_experts)


def run_experts_parallel(
    xs: torch.Tensor,
    counts: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: ProcessGroup,
) -> torch.Tensor:
    """Steps 2-4 of ``[Note: expert-parallel dispatch]``: ``xs`` (M, C) rows sorted by global
    expert with ``counts`` (E,) rows per expert -> (M, C) each row's expert output, same order.

    This rank of ``group`` holds experts ``rank * E/ep .. (rank + 1) * E/ep - 1``; ``experts(x, c)``
    runs them on ``x`` (R, C) sorted by local expert with ``c`` (E/ep,) rows each and returns (R, C).
    Differentiable in ``xs`` and in whatever ``experts`` uses. Collective over ``group``.
    """
    ep = dist.get_world_size(group)
    el = counts.numel() // ep
    with record_function("colossal.moe::dispatch"):
        recv = exchange_counts(counts, group)  # (ep, E_local)
        send_splits = counts.view(ep, el).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        xr = all_to_all_uneven(xs, send_splits, recv_splits, group, tag="moe.dispatch")  # (R, C)
        local = torch.arange(el, device=xs.device).repeat(ep).repeat_interleave(recv.reshape(-1).to(xs.device))
        order = torch.argsort(local, stable=True)  # (R,) by local expert, then source rank
    with record_function("colossal.moe::experts"):
        y = experts(xr.index_select(0, order), recv.sum(0))
    with record_function("colossal.moe::combine"):
        y = torch.empty_like(xr).index_copy(0, order, y)  # (R, C) back in arrival order
        return all_to_all_uneven(y, recv_splits, send_splits, group, tag="moe.combine")
