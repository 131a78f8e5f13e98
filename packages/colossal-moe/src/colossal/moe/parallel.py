"""Expert-parallel process groups, expert vs dense parameters, and gradient reduction.

[Note: which group reduces which gradient]
Take ``D`` data-parallel ranks, each with its own batch and training loss ``L_r``, and the total
loss ``(1/D) sum_r L_r`` (what DDP's average gives). Dense parameters (attention, router, norms)
are replicated on all ``D`` ranks: their gradient is the average of the ranks' gradients over
the full data-parallel group. Experts are split over ``ep`` consecutive ranks; the ranks holding
the *same* experts (``D / ep`` of them, strided by ``ep``) form the expert-data-parallel group
``edp``. The all-to-all backward already brings to an expert the gradient of every token its
``ep`` group sent it, so summing over ``edp`` covers all ``D`` ranks' tokens: expert gradients
are ``sum over edp / D`` (an average over ``edp`` further divided by ``ep``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

import colossal.comm as cc
from colossal.moe.layer import moe_layers

__all__ = ["ExpertGroups", "expert_groups", "expert_parameters", "dense_parameters", "reduce_gradients"]


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertGroups:
    """The groups of one expert-parallel layout."""

    ep: ProcessGroup
    """Ranks that split the experts between them (consecutive ranks)."""
    edp: ProcessGroup
    """Ranks holding the same experts (strided by ``ep``): reduce expert gradients."""
    dp: ProcessGroup | None
    """Every data-parallel rank (``None``: the world): reduces dense gradients."""
    ep_size: int
    """Size of ``ep``."""
    dp_size: int
    """Size of ``dp``."""


def expert_groups(ep_size: int, dp_group: ProcessGroup | None = None) -> ExpertGroups:
    """Split the data-parallel ranks (default: the world) into ``ep`` x ``edp`` groups.

    Validates before any collective: ``ep_size`` must be a positive int dividing the size of
    ``dp_group``. Every rank of the world must call it (group creation is collective), each with
    its own data-parallel group when ``dp_group`` is a sub-group (e.g. the ``dp`` axis of a
    ``dp x tp`` mesh): the ranks first learn every data-parallel group's members, then all of them
    create every group in the same order, as torch requires.
    """
    dp_size = dist.get_world_size(dp_group)
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if dp_size % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the data-parallel world size {dp_size}")
    mine = tuple(cc.group_ranks(dp_group))
    layouts = [mine]
    if dp_size != dist.get_world_size():  # a sub-group: learn the others' members
        ranks = torch.tensor(mine, dtype=torch.int64, device=cc.default_device())
        every = cc.all_gather(ranks, tag="moe.expert_groups").view(-1, dp_size).tolist()
        layouts = sorted({tuple(r) for r in every})
    me, ep, edp = dist.get_rank(), None, None
    for ranks in layouts:
        for i in range(0, dp_size, ep_size):  # ep: consecutive ranks of the dp group
            members = list(ranks[i : i + ep_size])
            g = dist.new_group(members)
            ep = g if me in members else ep
        for j in range(ep_size):  # edp: the ranks holding the same experts, strided by ep
            members = list(ranks[j::ep_size])
            g = dist.new_group(members)
            edp = g if me in members else edp
    return ExpertGroups(ep=ep, edp=edp, dp=dp_group, ep_size=ep_size, dp_size=dp_size)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of every MoE layer's experts (split over ``ep``)."""
    return [p for layer in moe_layers(model) for p in layer.experts.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter of ``model`` (replicated on all data-parallel ranks)."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def reduce_gradients(model: nn.Module, groups: ExpertGroups) -> None:
    """Average ``model``'s gradients over data parallelism, experts over their own group.

    Dense gradients: average over ``groups.dp``. Expert gradients: sum over ``groups.edp`` divided
    by ``groups.dp_size`` (see ``[Note: which group reduces which gradient]``). A parameter
    without a gradient is left untouched. One all-reduce per group over a flat buffer.
    """
    _reduce(dense_parameters(model), groups.dp, groups.dp_size, "moe.dense_grad")
    _reduce(expert_parameters(model), groups.edp, groups.dp_size, "moe.expert_grad")


def _reduce(params: list[nn.Parameter], group: ProcessGroup | None, divide_by: int, tag: str) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(group) > 1:
        cc.all_reduce(flat, group=group, tag=tag)
    flat.div_(divide_by)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
