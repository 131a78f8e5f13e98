"""Which plan the hybrid plugin applies to a model: the user's ``plan=``, or a built-in one (the
``colossalai`` GPT and PaLM, a Hugging Face family by ``model.config.model_type``), checked
against the model's module names before any collective.

[Note: one plan for tensor and sequence parallelism]
``colossal.tensor_parallel.parallelize`` takes one plan per mode: the tensor-parallel plan marks an
attention module ``HEADS`` (its head count is divided), the sequence plan marks the same module
``ATTENTION`` (it becomes ring / all-to-all attention). The plugin's ``plan=`` is one mapping for
both: a value is a :class:`~colossal.tensor_parallel.Style` or a tuple of them
(``"blocks.*.attn": (Style.HEADS, Style.ATTENTION)``). The tensor-parallel part is every style
except ``ATTENTION``; the sequence part is ``ATTENTION`` and ``POS_EMBED``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["ModelPlan", "check_user_plan", "model_plan"]


@dataclass(kw_only=True, slots=True)
class ModelPlan:
    """What the hybrid plugin does to one model."""

    tp: dict
    """Pattern -> Style for ``colossal.tensor_parallel.parallelize`` (1D/2D/2.5D/3D)."""
    sp: dict
    """Pattern -> Style (``ATTENTION``, ``POS_EMBED``) for sequence parallelism."""
    source: str
    """Where the plan comes from, for messages: ``"plan="``, ``"colossalai GPT"``, ``"hf:llama"``."""
    policy: object | None = None
    """A Hugging Face policy (:mod:`colossalai.policies`) when the model is a ``transformers`` one."""
    extra: dict = field(default_factory=dict)
    """Policy-specific settings (e.g. the GPT-2 fused projections)."""

    @property
    def splits_logits(self) -> bool:
        """Whether the tensor-parallel model's output is split along the vocabulary (an ``LM_HEAD``)."""
        from colossal.tensor_parallel import Style

        return any(Style(s) == Style.LM_HEAD for s in self.tp.values())

    @property
    def gathers_output(self) -> bool:
        """Whether a 2D/2.5D/3D model's output comes out whole (a ``GATHER`` head, e.g. the ViT classifier)."""
        from colossal.tensor_parallel import Style

        return any(Style(s) == Style.GATHER for s in self.tp.values())


def _styles(value) -> tuple:
    from colossal.tensor_parallel import Style

    values = value if isinstance(value, tuple | list) else (value,)
    try:
        return tuple(Style(v) for v in values)
    except ValueError:
        raise ValueError(f"plan value {value!r} is not a Style; choose from {[s.value for s in Style]}") from None


def check_user_plan(plan) -> dict:
    """``plan=`` as given to the plugin: a dict of ``str`` pattern -> Style (or a tuple of Styles)."""
    if not isinstance(plan, dict) or not plan:
        raise TypeError(f"plan must be a non-empty dict of module-name pattern -> Style, got {plan!r}")
    bad = [k for k in plan if not isinstance(k, str)]
    if bad:
        raise TypeError(f"plan keys must be str module-name patterns, got {bad}")
    return {pattern: _styles(value) for pattern, value in plan.items()}


def _split(plan: dict, model: nn.Module, source: str) -> ModelPlan:
    """Validate ``plan`` (pattern -> tuple of Styles) against ``model`` and split it by mode."""
    from colossal.tensor_parallel import Style, resolve_plan

    resolve_plan(model, {p: styles[0] for p, styles in plan.items()})  # every pattern used, none overlapping
    tp, sp = {}, {}
    for pattern, styles in plan.items():
        for style in styles:
            if style in (Style.ATTENTION, Style.POS_EMBED):
                sp[pattern] = style
            if style != Style.ATTENTION:
                tp[pattern] = style
    return ModelPlan(tp=tp, sp=sp, source=source)


def _builtin(model: nn.Module, tp_mode: str) -> ModelPlan | None:
    from colossal.tensor_parallel import gpt_plan
    from colossalai.models import GPT, PaLM
    from colossalai.policies import PaLMPolicy, hf_policy

    if isinstance(model, GPT):
        return ModelPlan(tp=gpt_plan(tp_mode), sp=gpt_plan("sequence"), source="colossalai GPT")
    policy = PaLMPolicy() if isinstance(model, PaLM) else hf_policy(model)
    if policy is None:
        return None
    if isinstance(model, PaLM):
        return ModelPlan(tp=policy.plan(model), sp={}, source="colossalai PaLM", policy=policy)
    return ModelPlan(tp=policy.plan(model, tp_mode), sp={}, source=f"hf:{policy.model_type}", policy=policy)


def _check_sequence(model: nn.Module, sp: dict) -> None:
    from colossal.tensor_parallel import Style, check_convertible, resolve_plan

    for _name, module, style in resolve_plan(model, sp):
        if style == Style.ATTENTION:
            check_convertible(module)


def model_plan(
    model: nn.Module,
    plan: dict | None,
    *,
    tp_size: int,
    sp_size: int,
    tp_mode: str,
    sp_kind: str,
    pp_size: int,
    tp_depth: int = 1,
) -> ModelPlan | None:
    """The plan for ``model``: the user's (validated), else a built-in one, else ``None`` when
    there is no tensor or sequence parallelism to apply. Raises ``ValueError`` / ``TypeError`` (on
    every rank, before any collective) for a plan that does not fit the model, a model its policy
    cannot split with these sizes, or a model that needs a plan and has none. A ``peft`` model's
    plan is its base model's (``[Note: LoRA under 1D tensor parallelism]`` in :mod:`.adapters`)."""
    from colossalai.booster.hybrid.adapters import lora_base

    model = lora_base(model)
    if plan is not None:
        found = _split(plan, model, "plan=")
    else:
        found = _builtin(model, tp_mode)
    if found is not None and found.policy is not None:
        from colossalai.policies import HFPolicy

        depth = {"tp_depth": tp_depth} if isinstance(found.policy, HFPolicy) else {}  # the 2.5D depth
        found.policy.check(model, tp_size, sp_size, tp_mode, sp_kind, pp_size, **depth)
    elif found is not None and sp_size > 1:
        _check_sequence(model, found.sp)
    if found is not None or (tp_size == 1 and sp_size == 1):
        return found
    from colossal.tensor_parallel import module_names

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    known = "" if model_type is None else f" (config.model_type={model_type!r} has no built-in policy)"
    raise ValueError(
        f"HybridParallelPlugin has no tensor/sequence-parallel plan for {type(model).__name__}{known}: "
        f"pass plan={{module-name pattern: Style}} (colossal.tensor_parallel.Style); "
        f"its modules are: {module_names(model)}"
    )
