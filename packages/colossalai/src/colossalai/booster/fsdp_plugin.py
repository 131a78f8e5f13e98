"""Fully sharded data parallelism through PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

The reference sharded plugin: parameters, gradients and optimizer states are sharded over the
world; state dicts are DTensors, so its checkpoints interchange with every other plugin's.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from colossalai.booster.ddp_plugin import materialize_
from colossalai.booster.plugin import Plugin, ensure_process_group, param_names, rebind_optimizer, world_size
from colossalai.booster.precision import Precision

__all__ = ["TorchFSDPPlugin"]


class TorchFSDPPlugin(Plugin):
    """``fully_shard`` each transformer block (every child of ``model.blocks`` or
    ``model.layers`` when present), then the root. Needs torch.distributed to be initialised.
    """

    name = "fsdp"
    supported_precisions = (Precision.FP32, Precision.BF16)

    def __init__(self, *, reshard_after_forward: bool = True) -> None:
        self.reshard_after_forward = reshard_after_forward

    def configure(self, model: nn.Module, optimizer, precision: Precision):
        """Shard ``model`` block by block (meta models are materialised shard-wise when they
        provide ``init_weights``, densely otherwise)."""
        ensure_process_group("TorchFSDPPlugin")  # a plain single process gets a world of one
        names = param_names(model)
        lazy = any(p.is_meta for p in model.parameters()) and hasattr(model, "init_weights")
        if not lazy:
            model = materialize_(model, self.device)
        blocks = getattr(model, "blocks", None) or getattr(model, "layers", None) or []
        with torch.profiler.record_function("colossalai.booster::fsdp_wrap"):
            for block in blocks:
                fully_shard(block, reshard_after_forward=self.reshard_after_forward)
            fully_shard(model, reshard_after_forward=self.reshard_after_forward)
        if lazy:
            model.to_empty(device=self.device)
            model.init_weights()
        rebind_optimizer(optimizer, names, model)
        return model, optimizer

    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """Skip the gradient reduce-scatter of the backward passes inside the context."""

        @contextlib.contextmanager
        def ctx():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return ctx() if world_size() > 1 else contextlib.nullcontext()
