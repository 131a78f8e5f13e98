"""Sequence parallelism for Hugging Face models, by hooks: the model keeps its own ``forward``,
inputs (``input_ids``/``pixel_values``, ``attention_mask``, ``labels``) and outputs.

[Note: sequence parallelism inside a Hugging Face model]
* The model's top-level forward pre-hook takes the user's ``attention_mask`` (B, T) out of the
  call (the model would build a mask for the full length) and keeps it for the attention.
* A forward hook on the policy's ``split_after`` module (the embeddings) pads the ``(B, T, C)``
  sequence to a multiple of ``sp`` and keeps this rank's ``T/sp`` chunk. It is a plain slice:
  every rank computed the embeddings of the whole sequence, and a slice's backward hands each rank
  only its own chunk's gradient (no communication).
* Each attention module calls the attention function ``"colossal_sequence"`` (registered with
  ``transformers.AttentionInterface``; the model's ``config._attn_implementation`` names it),
  which runs ``colossal.tensor_parallel.ring_attention`` or ``all_to_all_attention`` on the local
  q/k/v with the module's own ``is_causal``, its ``scaling`` and the kept key-padding mask (the
  sequence padding masked too); grouped-query k/v heads are repeated to the query heads first.
* A forward hook on ``gather_after`` (the last norm) all-gathers the chunks and drops the padding.
  The gradient entering each chunk is multiplied by ``sp``: the parameters before the gather hold
  their chunk's share of the gradient, those after it the whole gradient, and DDP over
  ``dp x sp`` averages, so both end as plain data parallelism's mean gradient (``[Note:
  sequence-parallel gradients]`` in :mod:`colossalai.booster.hybrid.wrappers`).
* Rotary embeddings (Llama, Mixtral) compute angles from ``position_ids``; a pre-hook turns the
  chunk's local positions into global ones.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTION_NAME", "apply_hf_sequence", "check_sequence", "sequence_attention"]

ATTENTION_NAME = "colossal_sequence"
"""The name of the attention function in ``transformers.AttentionInterface``."""


class _SequenceState:
    """What the hooks of one model share during a forward."""

    def __init__(self, group, kind: str) -> None:
        self.group, self.kind = group, kind
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.user_mask: torch.Tensor | None = None  # (B, T) as the user gave it
        self.key_mask: torch.Tensor | None = None  # (B, T_padded) bool, False = not attended
        self.total = 0  # T
        self.padded = 0  # T rounded up to a multiple of the sp size


def _find(model: nn.Module, regex: str, what: str) -> list[tuple[str, nn.Module]]:
    found = [(n, m) for n, m in model.named_modules() if n and re.search(rf"(^|\.)({regex})$", n)]
    if not found:
        from colossal.tensor_parallel import module_names

        raise ValueError(f"sequence parallelism needs {what} (module {regex!r}); modules: {module_names(model)}")
    return found


def check_sequence(policy, model: nn.Module) -> None:
    """Every attention module states ``is_causal`` (bool); the split and gather modules exist once."""
    for name, module in _find(model, policy.attention, "the attention modules"):
        if not isinstance(getattr(module, "is_causal", None), bool):
            raise TypeError(
                f"{name} ({type(module).__name__}) cannot run sequence-parallel attention: it needs an "
                f"is_causal (bool) attribute, and q/k/v (B, heads, T, d) passed to the attention function"
            )
    for regex, what in ((policy.split_after, "the embeddings to split after"), (policy.gather_after, "the last norm")):
        found = _find(model, regex, what)
        if len(found) != 1:
            raise ValueError(f"sequence parallelism needs one {what}, found {[n for n, _ in found]}")


def sequence_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``transformers`` attention function of a sequence-parallel model: ``query (B, h, T/sp, d)``,
    ``key``/``value`` ``(B, h_kv, T/sp, d)`` -> ``((B, T/sp, h, d), None)``. ``attention_mask`` (built
    by the model for the local chunk) is ignored: the kept whole-sequence padding mask is used."""
    from colossal.tensor_parallel import all_to_all_attention, ring_attention

    state = getattr(module, "_colossal_sequence", None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} calls {ATTENTION_NAME!r} attention but was not converted")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads:  # grouped-query attention: each k/v head serves heads // kv_heads query heads
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    attend = ring_attention if state.kind == "ring" else all_to_all_attention
    out = attend(
        query, key, value, state.group, causal=module.is_causal, scale=scaling, key_mask=state.key_mask,
        dropout_p=dropout,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # (B, T/sp, h, d)


def _take_mask(state: _SequenceState, module, args, kwargs):
    if len(args) > 1:
        raise TypeError(
            f"under sequence parallelism pass {type(module).__name__}'s inputs after the first as keywords "
            f"(got {len(args)} positional)"
        )
    state.user_mask = kwargs.pop("attention_mask", None)
    return args, kwargs


def _split(state: _SequenceState, module, args, out):
    x = out  # (B, T, C)
    state.total = x.shape[1]
    pad = -state.total % state.size
    state.padded = state.total + pad
    mask = state.user_mask
    if mask is not None and mask.shape[-1] != state.total:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match the sequence length {state.total}")
    if mask is None and pad:
        mask = torch.ones(x.shape[0], state.total, dtype=torch.bool, device=x.device)
    state.key_mask = None if mask is None else F.pad(mask.bool(), (0, pad), value=False)
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    t = state.padded // state.size
    return x.narrow(1, state.rank * t, t)  # (B, T/sp, C)


def _gather(state: _SequenceState, module, args, out):
    from colossal.tensor_parallel import gather_sequence

    def whole(x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x.register_hook(lambda g: g * state.size)
        return gather_sequence(x, state.group).narrow(1, 0, state.total)  # (B, T, C)

    if isinstance(out, torch.Tensor):
        return whole(out)
    if hasattr(out, "to_tuple"):  # a transformers ModelOutput: its first field is the sequence
        first = next(iter(out.keys()))
        out[first] = whole(out[first])
        return out
    return (whole(out[0]), *out[1:])


def _global_positions(state: _SequenceState, module, args, kwargs):
    pos = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
    t = state.padded // state.size
    if pos.shape[-1] == state.total and state.total != t:  # the user's whole-sequence positions
        pos = F.pad(pos, (0, state.padded - state.total), value=0).narrow(-1, state.rank * t, t)
    else:  # the model's local 0..t-1
        pos = pos + state.rank * t
    if "position_ids" in kwargs:
        kwargs["position_ids"] = pos
        return args, kwargs
    return (args[0], pos, *args[2:]), kwargs


def apply_hf_sequence(policy, model: nn.Module, group, kind: str) -> None:
    """Install ``[Note: sequence parallelism inside a Hugging Face model]`` on ``model`` in place."""
    import functools

    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, sequence_attention)
    state = _SequenceState(group, kind)
    for _, module in _find(model, policy.attention, "the attention modules"):
        module._colossal_sequence = state
    model.config._attn_implementation = ATTENTION_NAME
    model.register_forward_pre_hook(functools.partial(_take_mask, state), with_kwargs=True)
    _find(model, policy.split_after, "the embeddings")[0][1].register_forward_hook(functools.partial(_split, state))
    _find(model, policy.gather_after, "the last norm")[0][1].register_forward_hook(functools.partial(_gather, state))
    if policy.rotary is not None:
        for _, rotary in _find(model, policy.rotary, "the rotary embedding"):
            rotary.register_forward_pre_hook(functools.partial(_global_positions, state), with_kwargs=True)
