"""How the hybrid plugin wraps a converted model so that the user's criterion runs unchanged:
the split logits of a tensor-parallel model are gathered into the full ``(B, T, V)``
(:class:`GatherLogits`), and a sequence-parallel model gets its chunk of the ids and gives back the
full logits (:class:`SequenceParallel`). Plus the checks of the plugin's sizes.

[Note: sequence-parallel gradients]
Each ``sp`` rank runs its ``T/sp`` tokens, the logits are all-gathered along the sequence and the
user's criterion gives every ``sp`` rank the loss of the whole local batch. The gather's backward
keeps each rank's own chunk, so a rank's gradients are its tokens' share of the full gradient: the
full gradient is their *sum* over ``sp``. DDP over the ``dp x sp`` group *averages*, so the
gradient entering the sequence model is multiplied by ``sp``: the average over ``dp x sp`` of
``sp x share`` is the mean over ``dp`` of the full gradients, as plain data parallelism gives.

[Note: tensor x sequence parallel]
With ``tp_size > 1`` and ``sp_size > 1`` (mesh ``dp x sp x tp``) the model is converted for tensor
parallelism first (any mode), then only its attention modules are replaced by
``SequenceParallelAttention``, which reuses the tensor-parallel q/k/v/out projections and runs
ring or all-to-all attention over the heads those projections hold locally. The forward
pre-hooks the tensor-parallel conversion put on the attention module (one shared all-reduce (1D)
or gather (2D, 2.5D, 3D) of the q/k/v input, the projections then skipping their own) move to the
replacement, which calls the projections on its input just as the dense attention did. The position
embedding keeps its tensor-parallel layer; a forward pre-hook shifts its positions by
``sp_rank * T/sp`` so every chunk embeds its global positions (what
``SequencePositionEmbedding`` does for a dense embedding). Parameters are exactly those of the
tensor-parallel model, so checkpoints and clipping are the tensor-parallel ones.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = [
    "TP_MODES",
    "SP_KINDS",
    "check_layout",
    "gather_fn",
    "GatherLogits",
    "SequenceParallel",
    "sequence_after_tensor",
]

TP_MODES = ("1d", "2d", "2.5d", "3d")
"""Tensor-parallel modes the hybrid plugin supports."""
SP_KINDS = ("ring", "all_to_all")
"""Sequence-parallel attentions the hybrid plugin supports."""
_GRID_POWER = {"2d": 2, "2.5d": 2, "3d": 3}


def check_layout(tp_size: int, tp_mode: str, tp_depth: int) -> None:
    """``tp_size`` must be ``q^2`` (2D), ``q^2 * tp_depth`` (2.5D) or ``q^3`` (3D)."""
    if tp_depth != 1 and tp_mode != "2.5d":
        raise ValueError(f"tp_depth is the 2.5D depth; expected 1 for tp_mode={tp_mode!r}, got {tp_depth}")
    if tp_mode not in _GRID_POWER:
        return
    power = _GRID_POWER[tp_mode]
    q = round((tp_size / tp_depth) ** (1 / power)) if tp_size % tp_depth == 0 else 0
    if q < 1 or q**power * tp_depth != tp_size:
        need = {"2d": "q^2", "2.5d": "q^2 * tp_depth", "3d": "q^3"}[tp_mode]
        raise ValueError(f"tp_mode={tp_mode!r} needs tp_size = {need}; got tp_size={tp_size}, tp_depth={tp_depth}")


def gather_fn(mode: str, target):
    """The mode's differentiable gather of split logits into the full ``(B, T, V)``."""
    import colossal.tensor_parallel as ctp

    if mode == "1d":
        return functools.partial(ctp.gather_output_1d, group=target)
    if mode == "2d":
        return functools.partial(ctp.gather_output_2d, grid=ctp.Grid2D.of(target))
    if mode == "2.5d":
        return functools.partial(ctp.gather_output_2p5d, grid=ctp.grid_2p5d(target))
    return functools.partial(ctp.gather_output_3d, grid=ctp.Grid3D.of(target), orient="L1")  # LM head emits L1


class GatherLogits(nn.Module):
    """Runs the tensor-parallel model and gathers its split logits into the full ``(B, T, V)``
    (``gather=None``: a model whose output is not split, returned as it is)."""

    def __init__(self, module: nn.Module, gather) -> None:
        super().__init__()
        self.module, self.gather = module, gather

    def forward(self, *args, **kwargs):
        """The wrapped model's output, gathered (as it is when ``gather`` is ``None``)."""
        out = self.module(*args, **kwargs)
        return out if self.gather is None else self.gather(out)


class SequenceParallel(nn.Module):
    """Splits ``(B, T)`` ids over ``sp``, runs the sequence-parallel model, gathers ``(B, T, V)``
    logits; the gradient entering the model is scaled by ``sp`` (``[Note: sequence-parallel gradients]``)."""

    def __init__(self, module: nn.Module, group, sp_size: int) -> None:
        super().__init__()
        self.module, self.group, self.sp_size = module, group, sp_size

    def forward(self, idx: torch.Tensor, *args, **kwargs):
        """``(B, T)`` ids -> ``(B, T, V)`` logits, every rank computing ``T/sp`` of the tokens."""
        from colossal.tensor_parallel import gather_sequence, split_sequence

        out = self.module(split_sequence(idx, self.group), *args, **kwargs)  # (B, T/sp, V)
        if out.requires_grad:
            out.register_hook(lambda g: g * self.sp_size)
        return gather_sequence(out, self.group)  # (B, T, V)


def _global_positions(module, args, *, group, limit: int):
    """Forward pre-hook: local positions ``(T/sp,)`` -> this sp rank's global positions."""
    import torch.distributed as dist

    pos = args[0]
    t = pos.shape[-1]  # T/sp
    offset = dist.get_rank(group) * t
    if offset + t > limit:
        total = t * dist.get_world_size(group)
        raise ValueError(f"sequence length {total} exceeds the {limit} positions of the embedding")
    return (pos + offset, *args[1:])


def sequence_after_tensor(model: nn.Module, group, kind: str, dense_shapes: dict, plan: dict) -> None:
    """Make a tensor-parallel model sequence parallel over ``group`` with the sequence ``plan``
    (``[Note: tensor x sequence parallel]``); ``dense_shapes``: parameter name -> dense shape, for
    the number of positions."""
    from colossal.tensor_parallel import Style, apply_sequence, resolve_plan

    attention = {k: s for k, s in plan.items() if s == Style.ATTENTION}
    replaced = {name: module for name, module, _ in resolve_plan(model, attention)}
    for name, module, style in resolve_plan(model, plan):
        if style == Style.POS_EMBED:
            limit = dense_shapes[f"{name}.weight"][0]
            module.register_forward_pre_hook(functools.partial(_global_positions, group=group, limit=limit))
    apply_sequence(model, group, attention, kind)
    for name, old in replaced.items():  # the tensor-parallel input hooks of the attention (note)
        new = model.get_submodule(name)
        for hook in old._forward_pre_hooks.values():
            new.register_forward_pre_hook(hook)
