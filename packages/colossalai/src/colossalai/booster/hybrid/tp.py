"""The tensor-parallel axis of the hybrid plugin: ``colossal.tensor_parallel`` on the mesh's ``tp`` axis."""

from __future__ import annotations

import itertools

from torch import nn

from colossalai.booster.hybrid.shards import ShardIndex
from colossalai.booster.hybrid.wrappers import GatherLogits, gather_fn

__all__ = ["apply_tp"]


def real_modules_plan(model: nn.Module, mode: str) -> dict:
    """``gpt_plan(mode)`` narrowed to the modules whose tensors are all real: under pipeline
    parallelism the other stages' modules are meta (``[Note: meta construction under pp]`` in
    :mod:`.pp`) and stay dense and meta, never run on this rank."""
    from colossal.tensor_parallel import gpt_plan, resolve_plan

    real = lambda m: not any(t.is_meta for t in itertools.chain(m.parameters(), m.buffers()))  # noqa: E731
    return {name: style for name, module, style in resolve_plan(model, gpt_plan(mode)) if real(module)}


def apply_tp(model: nn.Module, mesh, mode: str, depth: int) -> tuple[GatherLogits, ShardIndex | None]:
    """Convert ``model`` in place to ``mode`` (1d, 2d, 2.5d, 3d) over the ``tp`` axis; returns it
    wrapped so that its split logits come out gathered, and (2D/2.5D/3D) the shard index maps
    its checkpoints need (``[Note: shard index maps]``), built from the dense model first.
    A model holding meta tensors (other pipeline stages') has only its real modules converted."""
    from colossal.tensor_parallel import parallelize

    target = mesh.group("tp") if mode == "1d" else mesh.layout(mode, "tp", depth=depth)
    plan = real_modules_plan(model, mode) if any(t.is_meta for t in model.parameters()) else None
    convert = lambda m: parallelize(m, mode, target, plan, depth=depth)  # noqa: E731
    shards = ShardIndex(model, convert, mesh.group("tp")) if mode != "1d" else None
    convert(model)
    return GatherLogits(model, gather_fn(mode, target)), shards
