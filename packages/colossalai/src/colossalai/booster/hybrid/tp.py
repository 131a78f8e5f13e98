"""The tensor-parallel axis of the hybrid plugin: ``colossal.tensor_parallel`` on the mesh's ``tp`` axis."""

from __future__ import annotations

from torch import nn

from colossalai.booster.hybrid.plans import ModelPlan
from colossalai.booster.hybrid.shards import ShardIndex
from colossalai.booster.hybrid.wrappers import GatherLogits, gather_fn

__all__ = ["apply_tp"]


def apply_tp(model: nn.Module, mesh, mode: str, depth: int, plan: ModelPlan) -> tuple[GatherLogits, ShardIndex | None]:
    """Convert ``model`` in place to ``mode`` (1d, 2d, 2.5d, 3d) over the ``tp`` axis with
    ``plan``; returns it wrapped so that its split logits (if any) come out gathered, and the
    shard index maps its checkpoints need (``[Note: shard index maps]``; 2D/2.5D/3D, and 1D
    layouts that are not one contiguous split per parameter), built from the dense model first."""
    from colossal.tensor_parallel import parallelize

    target = mesh.group("tp") if mode == "1d" else mesh.layout(mode, "tp", depth=depth)

    def convert(m: nn.Module) -> None:
        if plan.policy is not None:  # a Hugging Face family: its own modules first (GPT-2 Conv1D)
            plan.policy.convert_tp(m, target, mode)
        if plan.tp:
            parallelize(m, mode, target, plan.tp, depth=depth)

    indexed = mode != "1d" or (plan.policy is not None and plan.policy.permutes)
    shards = ShardIndex(model, convert, mesh.group("tp")) if indexed else None
    convert(model)
    gather = gather_fn(mode, target) if mode != "1d" or plan.splits_logits else None
    return GatherLogits(model, gather), shards
