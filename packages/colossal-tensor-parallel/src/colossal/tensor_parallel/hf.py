"""Tensor-parallel plans of Hugging Face ``transformers`` families, as data: for each
``config.model_type``, regular expressions over module names mapped to :class:`Style`.
``transformers`` is not imported (the rules only read module names).

The rules match the end of a module name, so one rule serves every head class of a family
(``LlamaModel``, ``LlamaForCausalLM``, ...). Embeddings, norms and task heads are not in the
rules: they stay replicated (tied input/output embeddings stay tied). GPT-2's ``Conv1D`` layers
(transposed weights, a fused q/k/v projection) are not ``nn.Linear`` and are converted by the
``colossalai`` GPT-2 policy, so ``gpt2`` has no rules here.
"""

from __future__ import annotations

import re

from torch import nn

from colossal.tensor_parallel.plan import Style

__all__ = ["HF_TP_RULES", "HF_GRID_RULES", "hf_plan"]

_LLAMA_ATTENTION = [
    (r"layers\.\d+\.self_attn\.[qkv]_proj", Style.COL),
    (r"layers\.\d+\.self_attn\.o_proj", Style.ROW),
]

HF_TP_RULES: dict[str, list[tuple[str, Style]]] = {
    "llama": _LLAMA_ATTENTION
    + [(r"layers\.\d+\.mlp\.(gate|up)_proj", Style.COL), (r"layers\.\d+\.mlp\.down_proj", Style.ROW)],
    "mixtral": _LLAMA_ATTENTION,  # experts replicated: see the colossalai Mixtral policy
    "bert": [
        (r"layer\.\d+\.attention\.self\.(query|key|value)", Style.COL),
        (r"layer\.\d+\.attention\.output\.dense", Style.ROW),
        (r"layer\.\d+\.intermediate\.dense", Style.COL),
        (r"layer\.\d+\.output\.dense", Style.ROW),
    ],
    "vit": [
        (r"layers\.\d+\.attention\.[qkv]_proj", Style.COL),
        (r"layers\.\d+\.attention\.o_proj", Style.ROW),
        (r"layers\.\d+\.mlp\.fc1", Style.COL),
        (r"layers\.\d+\.mlp\.fc2", Style.ROW),
    ],
}
"""``model_type`` -> ``[(regex over the end of a module name, Style)]`` (1D tensor parallelism)."""

HF_GRID_RULES: dict[str, list[tuple[str, Style]]] = {
    "vit": [
        (r"embeddings\.patch_embeddings\.projection", Style.PATCH_EMBED),
        (r"embeddings", Style.VISION_EMBED),  # cls_token, position_embeddings
        (r"layers\.\d+\.layernorm_(before|after)", Style.NORM),
        (r"layernorm", Style.NORM),
        (r"classifier", Style.GATHER),  # on the CLS token: the logits come out whole
    ],
}
"""``model_type`` -> the rules 2D, 2.5D and 3D add to :data:`HF_TP_RULES`: the modes that split the
activations along the batch and the hidden size everywhere, so the embeddings, the norms and the
head must be converted too (families not listed: 1D only)."""


def hf_plan(model: nn.Module, model_type: str, mode: str = "1d") -> dict[str, Style]:
    """The exact-name plan (``{module name: Style}``) of ``model`` from ``HF_TP_RULES[model_type]``
    (plus ``HF_GRID_RULES[model_type]`` for ``mode`` 2d, 2.5d, 3d); ``ValueError`` when a rule
    matches no module (a renamed or unsupported architecture)."""
    if model_type not in HF_TP_RULES:
        raise NotImplementedError(f"no tensor-parallel rules for model_type {model_type!r}; have {sorted(HF_TP_RULES)}")
    table = HF_TP_RULES[model_type]
    if mode != "1d":
        if model_type not in HF_GRID_RULES:
            raise NotImplementedError(f"{model_type}: tensor-parallel mode {mode!r}; supported: '1d'")
        table = table + HF_GRID_RULES[model_type]
    rules = [(re.compile(rf"(^|\.){rx}$"), style) for rx, style in table]
    plan, used = {}, set()
    for name, _ in model.named_modules():
        for i, (rx, style) in enumerate(rules):
            if rx.search(name):
                plan[name] = style
                used.add(i)
                break
    unused = [table[i][0] for i in range(len(rules)) if i not in used]
    if unused:
        from colossal.tensor_parallel.plan import module_names

        raise ValueError(
            f"{model_type} rules {unused} match no module of {type(model).__name__}: {module_names(model)}"
        )
    return plan
