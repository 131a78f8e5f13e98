"""Parallelization plans: module-name patterns mapped to :class:`Style` (in the manner of
``torch.distributed.tensor.parallel.parallelize_module``), and the ready plan for the GPT of the
``colossalai`` meta-package.

A plan is a ``dict[str, Style]``; keys are ``fnmatch`` patterns over ``model.named_modules()``
names (``"blocks.*.attn.q_proj"``). One plan serves every tensor-parallel mode: each mode reads
the styles in its own way (``COL`` is a column-parallel linear in 1D, a SUMMA linear in 2D, the
"hidden-in-weight-axis" orientation in 3D).
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Callable

from torch import nn

from colossal.tensor_parallel.validation import check_divisible

__all__ = ["Style", "Factory", "gpt_plan", "module_names", "resolve_plan", "replace_module", "convert_model"]

Factory = Callable[[nn.Module], nn.Module | Callable[[nn.Module], None] | None]
"""Builds the parallel replacement of one dense module (``None``: keep the module as it is; a
callable that is not a module: a conversion applied to the module in place, after every
replacement is built)."""


class Style(enum.StrEnum):
    """How one module is parallelized."""

    COL = "col"
    """A linear whose output is consumed split (q/k/v, fc_in): 1D column-parallel; 3D layout L0 -> L1."""
    ROW = "row"
    """A linear consuming a split input (out_proj, fc_out): 1D row-parallel; 3D layout L1 -> L0."""
    EMBED = "embed"
    """A token embedding split along the hidden size."""
    VOCAB_EMBED = "vocab_embed"
    """A token embedding split along the vocabulary (its weight may be tied to ``LM_HEAD``)."""
    POS_EMBED = "pos_embed"
    """A position embedding (inputs are positions, not batch rows); replicated in 1D."""
    LM_HEAD = "lm_head"
    """The output projection: logits stay split along the vocabulary (vocab-parallel loss)."""
    NORM = "norm"
    """A LayerNorm over the (possibly split) hidden size."""
    HEADS = "heads"
    """A module with an ``n_head`` attribute: divided by the number of head shards."""
    ATTENTION = "attention"
    """Sequence parallel only: the attention core becomes ring / all-to-all attention."""
    PATCH_EMBED = "patch_embed"
    """A convolutional patch projection (``nn.Conv1d/2d/3d``) whose output channels are the hidden
    size: split like the hidden size, the images cut to this rank's batch block (2D/2.5D/3D; not
    under a ``VISION_EMBED`` module, which cut them); replicated in 1D."""
    VISION_EMBED = "vision_embed"
    """The module turning images into the first activations (a ViT's embeddings): its first input is
    cut to this rank's batch block, its own parameters over the hidden size (class token, learned
    positions) split along their last dimension and gathered for its forward (2D/2.5D/3D); its
    ``PATCH_EMBED`` child then takes the block as it comes. Replicated in 1D."""
    GATHER = "gather"
    """A replicated module fed by split activations (a classifier): its input is gathered to the full
    ``(B, ..., H)`` first (2D/2.5D/3D), so the model's output is whole; nothing to do in 1D."""


def gpt_plan(mode: str = "1d") -> dict[str, Style]:
    """The plan for the ``colossalai`` GPT (``wte``, ``wpe``, ``blocks.*.{ln_1, attn, ln_2, mlp}``,
    ``ln_f``, ``lm_head``) in ``mode`` (``"1d"``, ``"2d"``, ``"2.5d"``, ``"3d"``, ``"sequence"``)."""
    if mode == "sequence":
        return {"wpe": Style.POS_EMBED, "blocks.*.attn": Style.ATTENTION}
    if mode not in ("1d", "2d", "2.5d", "3d"):
        raise NotImplementedError(f"gpt_plan mode {mode!r}; supported: '1d', '2d', '2.5d', '3d', 'sequence'")
    return {
        "wte": Style.VOCAB_EMBED,
        "wpe": Style.POS_EMBED,
        "blocks.*.ln_1": Style.NORM,
        "blocks.*.attn": Style.HEADS,
        "blocks.*.attn.q_proj": Style.COL,
        "blocks.*.attn.k_proj": Style.COL,
        "blocks.*.attn.v_proj": Style.COL,
        "blocks.*.attn.out_proj": Style.ROW,
        "blocks.*.ln_2": Style.NORM,
        "blocks.*.mlp.fc_in": Style.COL,
        "blocks.*.mlp.fc_out": Style.ROW,
        "ln_f": Style.NORM,
        "lm_head": Style.LM_HEAD,
    }


def module_names(model: nn.Module, limit: int = 60) -> str:
    """``model``'s submodule names for error messages, the indices of ``nn.ModuleList`` entries
    folded into ``*`` (``blocks.*.attn.q_proj`` once, not once per layer; ``nn.Sequential``
    indices stay), at most ``limit`` of them."""
    lists = {name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    seen: dict[str, None] = {}
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        folded = ["*" if i and ".".join(parts[:i]) in lists else part for i, part in enumerate(parts)]
        if folded:
            seen.setdefault(".".join(folded), None)
    names = list(seen)
    more = f" ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def resolve_plan(model: nn.Module, plan: dict[str, Style | str]) -> list[tuple[str, nn.Module, Style]]:
    """``(name, module, style)`` for every module matched by a plan pattern, in module order.

    Raises ``ValueError`` for a pattern that matches nothing or a module matched twice."""
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict of pattern -> Style, got {type(plan).__name__}")
    styles = {pattern: Style(style) for pattern, style in plan.items()}
    out, used = [], set()
    for name, module in model.named_modules():
        hits = [p for p in styles if fnmatch.fnmatchcase(name, p)]
        if len(hits) > 1:
            raise ValueError(f"module {name!r} matches several plan patterns: {hits}")
        if hits:
            used.add(hits[0])
            out.append((name, module, styles[hits[0]]))
    unused = sorted(set(styles) - used)
    if unused:
        raise ValueError(
            f"plan patterns {unused} match no module of {type(model).__name__}; its modules are: {module_names(model)}"
        )
    return out


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``model``'s submodule ``name`` was (``name`` must not be empty)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _like_dense(new: nn.Module, dense: nn.Module) -> None:
    """Put ``new`` on ``dense``'s device and floating dtype (the parallel layers allocate their
    shards on the CPU in float32; a CUDA or bf16 model must stay one)."""
    ref = next(dense.parameters(), None)
    if ref is not None and not ref.is_meta:
        new.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)


def convert_model(
    model: nn.Module, plan: dict[str, Style | str], factories: dict[Style, Factory], head_shards: int, mode: str
) -> nn.Module:
    """Apply ``plan`` to ``model`` in place with one mode's ``factories`` and return ``model``.

    Every replacement is built (and every shape validated) before the model is touched, so an error
    leaves the model unchanged. A ``LM_HEAD`` whose dense weight is tied to a converted embedding's
    weight shares that embedding's parallel weight (both use the same sharding by construction).
    """
    entries = resolve_plan(model, plan)
    built: list[tuple[str, nn.Module]] = []
    in_place: list[tuple[nn.Module, Callable[[nn.Module], None]]] = []
    by_weight: dict[int, nn.Module] = {}
    for name, module, style in entries:
        if style == Style.HEADS:
            n_head = getattr(module, "n_head", None)
            if not isinstance(n_head, int):
                raise ValueError(f"{name}: Style.HEADS needs an int attribute n_head, got {n_head!r}")
            check_divisible(n_head, head_shards, f"{name}.n_head", f"the {mode} head shards")
            continue
        if style not in factories:
            raise NotImplementedError(f"{mode} does not support {style!r} ({name}); supported: {sorted(factories)}")
        new = factories[style](module)
        if new is None:
            continue
        if not isinstance(new, nn.Module):  # an in-place conversion (hooks, split own parameters)
            in_place.append((module, new))
            continue
        _like_dense(new, module)
        weight = getattr(module, "weight", None)
        if style == Style.LM_HEAD and weight is not None and id(weight) in by_weight:
            new.weight = by_weight[id(weight)].weight  # tied embeddings stay tied
        elif weight is not None:
            by_weight[id(weight)] = new
        built.append((name, new))
    for _name, module, style in entries:
        if style == Style.HEADS:
            module.n_head //= head_shards
    for name, new in built:
        replace_module(model, name, new)
    for module, convert in in_place:
        convert(module)
    return model
