"""The sequence-parallel axis of the hybrid plugin: ring / all-to-all attention on the ``sp`` axis."""

from __future__ import annotations

import torch
from torch import nn

from colossalai.booster.hybrid.adapters import base_prefix, lora_base
from colossalai.booster.hybrid.plans import ModelPlan
from colossalai.booster.hybrid.wrappers import SequenceParallel, sequence_after_tensor

__all__ = ["apply_sp"]


def apply_sp(model: nn.Module, inner: nn.Module, mesh, kind: str, dense_shapes: dict, plan: ModelPlan) -> nn.Module:
    """Sequence parallel over ``sp``; ``inner`` is ``model`` itself or, after :func:`.tp.apply_tp`,
    its gathering wrapper. After tp the tensor-parallel layers run unchanged on each ``T/sp``
    chunk, the attention core becomes ring / all-to-all over the local heads, and the (converted)
    position embedding sees global positions (``[Note: tensor x sequence parallel]`` in
    :mod:`colossalai.booster.hybrid.wrappers`). A Hugging Face model is split and gathered inside
    by its policy (:mod:`colossalai.policies`), so its inputs and outputs stay those of the model."""
    from colossal.tensor_parallel import parallelize

    sp = mesh.group("sp")
    if plan.policy is not None:
        return plan.policy.apply_sequence(model, inner, sp, kind)
    if not plan.sp:
        raise ValueError(f"sequence parallelism needs ATTENTION entries in the plan ({plan.source}); got none")
    if inner is model:  # the plan names the base model's modules (a peft model's too)
        parallelize(lora_base(model), "sequence", sp, plan.sp, kind=kind)
    else:  # a peft model: the plan and the shapes by the base's names
        prefix = base_prefix(model)
        shapes = {k.removeprefix(prefix): v for k, v in dense_shapes.items() if k.startswith(prefix)}
        sequence_after_tensor(lora_base(model), sp, kind, shapes, plan.sp)
    return SequenceParallel(inner, sp, torch.distributed.get_world_size(sp))
