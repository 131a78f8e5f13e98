"""The tensor-parallel axis of the hybrid plugin: ``colossal.tensor_parallel`` on the mesh's ``tp`` axis."""

from __future__ import annotations

import itertools

from torch import nn

from colossalai.booster.hybrid.adapters import convert_with_adapters, lora_base
from colossalai.booster.hybrid.plans import ModelPlan
from colossalai.booster.hybrid.shards import ShardIndex
from colossalai.booster.hybrid.wrappers import GatherLogits, gather_fn

__all__ = ["apply_tp"]


def real_modules_plan(model: nn.Module, plan: dict) -> dict:
    """``plan`` narrowed to the modules whose tensors are all real: under pipeline parallelism the
    other stages' modules are meta (``[Note: meta construction under pp]`` in :mod:`.pp`) and stay
    dense and meta, never run on this rank."""
    from colossal.tensor_parallel import resolve_plan

    real = lambda m: not any(t.is_meta for t in itertools.chain(m.parameters(), m.buffers()))  # noqa: E731
    return {name: style for name, module, style in resolve_plan(model, plan) if real(module)}


def apply_tp(model: nn.Module, mesh, mode: str, depth: int, plan: ModelPlan) -> tuple[GatherLogits, ShardIndex | None]:
    """Convert ``model`` in place to ``mode`` (1d, 2d, 2.5d, 3d) over the ``tp`` axis with
    ``plan``; returns it wrapped so that its split logits (if any) come out gathered, and the
    shard index maps its checkpoints need (``[Note: shard index maps]``; 2D/2.5D/3D, and 1D
    layouts that are not one contiguous split per parameter), built from the dense model first.
    A model holding meta tensors (other pipeline stages') has only its real modules converted; a
    ``peft`` model has its base converted and its adapters split to match (``[Note: LoRA under 1D
    tensor parallelism]`` in :mod:`.adapters`)."""
    from colossal.tensor_parallel import parallelize

    target = mesh.group("tp") if mode == "1d" else mesh.layout(mode, "tp", depth=depth)
    tp_plan = plan.tp
    if tp_plan and any(t.is_meta for t in model.parameters()):
        tp_plan = real_modules_plan(lora_base(model), tp_plan)

    def convert_base(m: nn.Module) -> None:
        if plan.policy is not None:  # a Hugging Face family: its own modules first (GPT-2 Conv1D)
            plan.policy.convert_tp(m, target, mode)
        if tp_plan:
            parallelize(m, mode, target, tp_plan, depth=depth)

    def convert(m: nn.Module) -> None:
        convert_with_adapters(m, convert_base, mesh.group("tp"))

    indexed = mode != "1d" or (plan.policy is not None and plan.policy.permutes)
    shards = ShardIndex(model, convert, mesh.group("tp")) if indexed else None
    convert(model)
    split_output = (mode != "1d" and not plan.gathers_output) or plan.splits_logits
    gather = gather_fn(mode, target) if split_output else None
    return GatherLogits(model, gather), shards
