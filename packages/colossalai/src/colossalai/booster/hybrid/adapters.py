"""LoRA adapters under the hybrid plugin: a ``peft`` model split by 1D tensor parallelism (and sp, pp, ep).

[Note: LoRA under 1D tensor parallelism]
The tensor-parallel plan (a policy's, or the user's ``plan=``) names the modules of the *base*
model. A ``peft`` LoRA layer wraps its base layer (``q_proj`` becomes a ``LoraLayer`` holding
``base_layer``, ``lora_A`` and ``lora_B``), so the plugin converts the base model with every LoRA
layer swapped back for its base layer (the plan and the policies see the model they know), then
puts each LoRA layer back around its converted base layer and splits the adapter to match:

* **column-parallel base** (``W: in -> out/P``, input replicated): ``lora_A`` stays replicated,
  ``lora_B`` becomes column-parallel (``r -> out/P``, with the base's row order: GPT-2's fused
  ``c_attn`` holds q, k, v of its own heads). ``lora_B``'s input gradient is all-reduced, so
  ``dh = B^T dy`` is whole on every rank and ``lora_A``'s gradient is the dense one, identical on
  every rank (no extra all-reduce of it). Where the base skips its own input all-reduce because
  the parent attention does it once for q, k and v (``[Note: one input all-reduce for q, k and v]``
  in :mod:`colossal.tensor_parallel.one_d`), the adapter's input gradient, whole on every rank,
  is divided by ``P`` before that all-reduce sums it.
* **row-parallel base** (``W: in/P -> out``, output all-reduced): ``lora_A`` becomes row-parallel
  (``in/P -> r``, its output all-reduced), ``lora_B`` stays replicated; every gradient is then the
  dense one (``lora_B``'s identical on every rank).
* a base that stays replicated (an embedding, a norm, a head): its adapter stays replicated.

The other axes need little of their own. Sequence parallelism: the adapter is replicated over
``sp`` and averaged as any parameter. Pipeline parallelism cuts the *base* model's blocks (the
stages name parameters from the base, :func:`base_prefix` maps them back); LoRA layers travel with
their blocks, and a frozen tied embedding gets no gradient on either stage. Expert parallelism
splits the expert layers as frozen base weights; an adapter inside one is refused
(:func:`check_frozen_experts`).

Each adapter keeps peft's names (``...q_proj.lora_B.default.weight``), so the plugin's
checkpoints hold the dense adapter under those names (1D: DTensors ``Shard(0)`` / ``Shard(1)``;
GPT-2's permuted rows: the shard index maps) and ``peft.PeftModel.from_pretrained`` reads what
``save_lora_as_pretrained`` writes. Parameters that were frozen before the conversion (the whole
base) stay frozen after it: the tensor-parallel and expert-parallel layers are new modules whose
parameters would otherwise require grad, so the plugin freezes them again by name after every
axis. Supported: plain LoRA on linear layers (``Linear``, GPT-2's ``Conv1D``); DoRA, LoRA biases
and adapters of a base split some other way raise ``NotImplementedError``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["base_prefix", "check_frozen_experts", "check_lora_layout", "convert_with_adapters", "lora_base"]


def lora_base(model: nn.Module) -> nn.Module:
    """The model a tensor-parallel plan names: a ``peft.PeftModel``'s base model, else ``model``."""
    from colossalai.booster.lora import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def base_prefix(model: nn.Module) -> str:
    """What the names of :func:`lora_base` lack of ``model``'s (``"base_model.model."`` for a peft model)."""
    base = lora_base(model)
    if base is model:
        return ""
    return next(n for n, m in model.named_modules() if m is base) + "."


def check_lora_layout(*, tp_mode: str, tp_size: int = 1, model: nn.Module | None = None) -> None:
    """``NotImplementedError`` (local, before any process group or collective, on every rank) for a
    tensor-parallel mode that LoRA adapters cannot be split in yet (2D, 2.5D, 3D: their blocks are
    not one split of a linear layer's rows or columns); with ``model`` (a ``peft`` model) also for
    adapters that 1D tensor parallelism cannot split (DoRA, LoRA biases) and for a peft model built
    on the meta device (materialising it would re-initialise the adapter: build it on a real
    device, or materialise the meta base before ``get_peft_model``)."""
    if tp_mode != "1d":
        raise NotImplementedError(
            f"LoRA under tensor parallelism needs tp_mode '1d' (got {tp_mode!r}); LoRA composes with 1D tp, "
            "sp, pp, ep and dp (zero_stage 0-2)"
        )
    if model is None:
        return
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise NotImplementedError(
            f"a peft model with meta tensors ({len(meta)}, e.g. {meta[0]!r}) under HybridParallelPlugin: "
            "materialising would re-initialise its adapter; build the base on a real device (or materialise "
            "it) before get_peft_model / Booster.enable_lora"
        )
    if tp_size > 1:
        for name, layer in _adapted(model).items():
            _check_plain(name, layer)


def check_frozen_experts(model: nn.Module, expert_layers) -> None:
    """Expert parallelism of a ``peft`` model: its expert layers (``expert_layers(model)``: name ->
    layer, found with every LoRA layer swapped back for its base layer) split over ``ep`` as frozen
    base weights; a LoRA adapter inside one raises ``NotImplementedError`` naming it (adapt the
    attention, or the layers outside the experts)."""
    from colossalai.booster.lora import is_peft_model

    if not is_peft_model(model):
        return
    prefix = base_prefix(model)
    with _base_layers_in_place(model) as layers:
        experts = list(expert_layers(model))
    inside = sorted(
        prefix + n for n in layers if any((prefix + n).startswith(e + ".") or prefix + n == e for e in experts)
    )
    if inside:
        raise NotImplementedError(
            f"LoRA under expert parallelism adapts the layers outside the experts; these are inside expert layers "
            f"split over ep: {inside[:4]}{' ...' if len(inside) > 4 else ''}"
        )


def _adapted(model: nn.Module) -> dict[str, nn.Module]:
    """Name (in the base model) -> peft LoRA layer wrapping a base layer, in module order."""
    from peft.tuners.lora import LoraLayer

    base = lora_base(model)
    return {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (see the note: an input gradient that the
    parent attention all-reduces once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _SharedInputDropout(nn.Module):
    """A LoRA layer's dropout whose input gradient is divided by the group size: the parent sums
    the whole gradient of every rank (``[Note: LoRA under 1D tensor parallelism]``)."""

    def __init__(self, dropout: nn.Module, group_size: int) -> None:
        super().__init__()
        self.dropout, self.scale = dropout, 1.0 / group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``dropout(x)``; backward scales the gradient of ``x``."""
        return self.dropout(_ScaleGrad.apply(x, self.scale))


def _check_plain(name: str, layer: nn.Module) -> None:
    adapters = list(layer.lora_A)
    if getattr(layer, "lora_variant", None) or any(getattr(layer, "use_dora", {}).get(a) for a in adapters):
        raise NotImplementedError(f"LoRA under tensor parallelism: {name!r} uses a LoRA variant (DoRA); plain LoRA")
    if any(layer.lora_B[a].bias is not None for a in adapters):
        raise NotImplementedError(f"LoRA under tensor parallelism: {name!r} has a LoRA bias (lora_bias=True)")


def _split_adapter(name: str, layer: nn.Module, group, converted: bool) -> None:
    """Split ``layer``'s adapters to match its ``base_layer`` (see the note); ``converted``: whether
    the tensor-parallel conversion replaced the base layer (else it stays replicated, and so does
    the adapter)."""
    import torch.distributed as dist

    from colossal.tensor_parallel import Linear1D

    base = layer.base_layer
    if not converted or dist.get_world_size(group) == 1:  # replicated, or a tp "group" of one
        return
    if not isinstance(base, Linear1D):
        raise NotImplementedError(
            f"LoRA under tensor parallelism: {name!r} became {type(base).__name__}; adapters follow column- "
            "and row-parallel linear layers only (leave that module out of target_modules)"
        )
    p = dist.get_world_size(group)  # plain LoRA: check_lora_layout refused DoRA and biases at boost
    for adapter in list(layer.lora_A):
        a, b = layer.lora_A[adapter], layer.lora_B[adapter]
        if base.style == "col":
            rows = getattr(base, "dense_rows", None)
            if rows is not None:  # the base's output features in its own order (GPT-2's per-head c_attn)
                with torch.no_grad():
                    b.weight.copy_(b.weight[rows.to(b.weight.device)])
            new_b = Linear1D.from_dense(b, group, "col")
            layer.lora_B[adapter] = _like(new_b, b)
            if not base.sync_input_grad:
                layer.lora_dropout[adapter] = _SharedInputDropout(layer.lora_dropout[adapter], p)
        else:
            layer.lora_A[adapter] = _like(Linear1D.from_dense(a, group, "row"), a)


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` on ``old``'s device and dtype (the parallel layers allocate fp32 on the CPU; which
    parameters train is restored by name by the plugin after every axis)."""
    return new.to(device=old.weight.device, dtype=old.weight.dtype)


@contextlib.contextmanager
def _base_layers_in_place(model: nn.Module):
    """The base model with every LoRA layer replaced by its base layer; yields ``{name: (lora layer,
    its base layer before)}`` and puts each LoRA layer back (around whatever is at its name then) on exit."""
    from colossal.tensor_parallel import replace_module

    base = lora_base(model)
    layers = _adapted(model)
    hooks = {name: set(layer.base_layer._forward_hooks) for name, layer in layers.items()}
    for name, layer in layers.items():
        replace_module(base, name, layer.base_layer)
    before = {name: layer.base_layer for name, layer in layers.items()}
    try:
        yield {name: (layer, before[name]) for name, layer in layers.items()}
    finally:
        for name, layer in layers.items():
            try:
                layer.base_layer = base.get_submodule(name)
            except AttributeError:  # the conversion failed after replacing a parent: its error is the one to see
                continue
            replace_module(base, name, layer)
            if layer.base_layer is before[name]:
                _move_output_hooks(layer, hooks[name])


def _move_output_hooks(layer: nn.Module, kept: set) -> None:
    """Forward hooks the conversion registered on a base layer it kept (PaLM's replicated k / v
    projections all-reduce their output gradient over tp) act on the LoRA layer's output instead:
    peft adds the adapter's output after the base layer's, and the adapter needs the same."""
    base = layer.base_layer
    for key in [k for k in base._forward_hooks if k not in kept]:
        hook = base._forward_hooks.pop(key)
        base._forward_hooks_with_kwargs.pop(key, None)
        base._forward_hooks_always_called.pop(key, None)
        layer.register_forward_hook(hook)


def convert_with_adapters(model: nn.Module, convert_base, group) -> None:
    """Run ``convert_base(base_model)`` (the 1D conversion of a plan and/or a policy) on ``model``,
    a ``peft`` model or not; a ``peft`` model's adapters are split to match their converted base
    layers (``[Note: LoRA under 1D tensor parallelism]``)."""
    from colossalai.booster.lora import is_peft_model

    if not is_peft_model(model):
        return convert_base(model)
    with _base_layers_in_place(model) as layers:
        convert_base(lora_base(model))
    for name, (layer, before) in layers.items():
        _split_adapter(name, layer, group, converted=layer.base_layer is not before)
