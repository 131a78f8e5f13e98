"""The tensor-parallel axis of the hybrid plugin: ``colossal.tensor_parallel`` on the mesh's ``tp`` axis."""

from __future__ import annotations

from torch import nn

from colossalai.booster.hybrid.shards import ShardIndex
from colossalai.booster.hybrid.wrappers import GatherLogits, gather_fn

__all__ = ["apply_tp"]


def apply_tp(model: nn.Module, mesh, mode: str, depth: int) -> tuple[GatherLogits, ShardIndex | None]:
    """Convert ``model`` in place to ``mode`` (1d, 2d, 2.5d, 3d) over the ``tp`` axis; returns it
    wrapped so that its split logits come out gathered, and (2D/2.5D/3D) the shard index maps
    its checkpoints need (``[Note: shard index maps]``), built from the dense model first."""
    from colossal.tensor_parallel import parallelize

    target = mesh.group("tp") if mode == "1d" else mesh.layout(mode, "tp", depth=depth)
    convert = lambda m: parallelize(m, mode, target, depth=depth)  # noqa: E731
    shards = ShardIndex(model, convert, mesh.group("tp")) if mode != "1d" else None
    convert(model)
    return GatherLogits(model, gather_fn(mode, target)), shards
