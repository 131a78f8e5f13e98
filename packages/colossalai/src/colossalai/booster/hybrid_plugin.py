"""Hybrid parallelism: data x tensor through ``colossal.tensor_parallel`` on a ``colossal.comm.Mesh``.

Layout: ``Mesh(axes={"dp": world // tp_size, "tp": tp_size})``. The model is converted in place
by ``colossal.tensor_parallel.parallelize(model, "1d", tp_group)`` (Megatron column/row splits,
vocab-parallel embedding and head), its vocab-split logits are gathered so that the user's
criterion runs unchanged, and gradients are averaged over the ``dp`` axis by DDP on the dp group.

[Note: tensor-parallel state in checkpoints]
A 1D-parallel parameter is an even split, in rank order, of the dense parameter along one
dimension, i.e. exactly a ``DTensor`` with ``Shard(dim)`` on the ``tp`` sub-mesh. State dicts are
therefore handed to DCP as DTensors (dimension found by comparing with the dense shapes recorded
before conversion), so that checkpoints reshard to any other plugin or layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from colossalai.booster.ddp_plugin import materialize_
from colossalai.booster.plugin import Plugin, param_names, rebind_optimizer, world_size
from colossalai.booster.precision import Precision
from colossalai.booster.wrappers import BoostedOptimizer

__all__ = ["HybridParallelPlugin", "TensorParallelOptimizer"]

_SUPPORTED_MODES = ("1d",)


class _GatherLogits(nn.Module):
    """Runs the tensor-parallel model and all-gathers its vocab-split logits (B, T, V/P) -> (B, T, V)."""

    def __init__(self, module: nn.Module, group) -> None:
        super().__init__()
        self.module, self.group = module, group

    def forward(self, *args, **kwargs):
        from colossal.tensor_parallel import gather_output_1d

        return gather_output_1d(self.module(*args, **kwargs), self.group)


class TensorParallelOptimizer(BoostedOptimizer):
    """Clips by the norm of the *dense* gradients: tp-sharded gradients are summed over the tp
    group, replicated ones (LayerNorms, position embedding) counted once
    (``colossal.optim.clip_grad_norm_``)."""

    def __init__(self, optimizer, sharded: list, replicated: list, tp_group) -> None:
        super().__init__(optimizer)
        self.sharded, self.replicated, self.tp_group = sharded, replicated, tp_group

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Total norm of the dense gradients (identical on every rank), clipped in place."""
        from colossal.optim import clip_grad_norm_

        grads = lambda ps: [p.grad for p in ps if p.grad is not None]
        return clip_grad_norm_(grads(self.sharded), max_norm, norm_type, group=self.tp_group,
                               replicated=grads(self.replicated))  # fmt: skip


class HybridParallelPlugin(Plugin):
    """``HybridParallelPlugin(tp_size=2, tp_mode="1d")``: tensor parallel inside groups of
    ``tp_size`` ranks, data parallel across them. Supported now: ``tp_mode="1d"``, ``sp_size=1``,
    ``zero_stage=0``; other values raise ``NotImplementedError``. fp32 and bf16 (fp16 would need an
    overflow check agreed over the tp group).
    """

    name = "hybrid"
    supported_precisions = (Precision.FP32, Precision.BF16)

    def __init__(self, *, tp_size: int = 2, tp_mode: str = "1d", sp_size: int = 1, zero_stage: int = 0) -> None:
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if tp_mode not in _SUPPORTED_MODES:
            raise NotImplementedError(f"HybridParallelPlugin supports tp_mode in {_SUPPORTED_MODES}, got {tp_mode!r}")
        if sp_size != 1 or zero_stage != 0:
            raise NotImplementedError(
                f"HybridParallelPlugin supports sp_size=1 and zero_stage=0 for now, got {sp_size} and {zero_stage}"
            )
        self.tp_size, self.tp_mode = tp_size, tp_mode
        self.mesh = None
        self._dense_shapes: dict[str, torch.Size] = {}

    def _build_mesh(self):
        from colossal.comm import Mesh

        if world_size() % self.tp_size:
            raise ValueError(f"world size {world_size()} must be divisible by tp_size={self.tp_size}")
        if self.mesh is None:
            self.mesh = Mesh(axes={"dp": world_size() // self.tp_size, "tp": self.tp_size})
        return self.mesh

    @property
    def dp_group(self):
        """The data-parallel process group."""
        return self._build_mesh().group("dp")

    def dp_size(self) -> int:
        """Replicas along the dp axis."""
        return world_size() // self.tp_size

    def dp_rank(self) -> int:
        """This rank's dp coordinate (tp peers read the same data)."""
        return self._build_mesh().coordinate("dp")

    def configure(self, model: nn.Module, optimizer, precision):
        """Materialise, convert to tensor parallel, gather logits, wrap in DDP over dp."""
        from colossal.tensor_parallel import parallelize

        if not torch.distributed.is_initialized():
            raise ValueError("HybridParallelPlugin needs torch.distributed initialised (torchrun or launch())")
        mesh = self._build_mesh()
        names = param_names(model)
        model = materialize_(model, self.device)
        self._dense_shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
        with torch.profiler.record_function("colossalai.booster::tensor_parallel"):
            parallelize(model, self.tp_mode, mesh.group("tp"))
        rebind_optimizer(optimizer, names, model)
        if optimizer is not None:
            optimizer = self._tp_optimizer(optimizer, model, mesh.group("tp"))
        wrapped: nn.Module = _GatherLogits(model, mesh.group("tp"))
        if self.dp_size() > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DDP(wrapped, device_ids=ids, process_group=mesh.group("dp"))
        return wrapped, optimizer

    def _tp_optimizer(self, optimizer, model: nn.Module, tp_group) -> TensorParallelOptimizer:
        params = dict(model.named_parameters())
        sharded = [p for n, p in params.items() if p.shape != self._dense_shapes[n]]
        replicated = [p for n, p in params.items() if p.shape == self._dense_shapes[n]]
        return TensorParallelOptimizer(optimizer, sharded, replicated, tp_group)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The (tensor-parallel) user module."""
        model = model.module if isinstance(model, DDP) else model
        return model.module if isinstance(model, _GatherLogits) else model

    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` over the dp axis."""
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    # ---- state: DTensors over the tp axis (see the module note) --------------------------------
    def _to_dtensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        dense = self._dense_shapes[name]
        dims = [d for d in range(local.dim()) if local.shape[d] != dense[d]]
        placement = Shard(dims[0]) if dims else Replicate()
        return DTensor.from_local(local, self.mesh.device_mesh["tp"], [placement], run_check=False)

    def model_state_dict(self, model: nn.Module) -> dict:
        """Parameters as tp-sharded DTensors under their dense names (buffers as they are)."""
        module = self.unwrap(model)
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names included
        return {n: self._to_dtensor(n, t.detach()) if n in params else t for n, t in module.state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        """Copy each loaded DTensor's local shard into the parameter."""
        module = self.unwrap(model)
        with torch.no_grad():
            for n, t in module.state_dict(keep_vars=True).items():
                t.copy_(state[n].to_local() if isinstance(state[n], DTensor) else state[n])

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The dense model (all-gathered over tp) on every rank."""
        sd = self.model_state_dict(model)
        return {n: t.full_tensor().cpu() if isinstance(t, DTensor) else t.cpu() for n, t in sd.items()}

    def optimizer_state_dict(self, model: nn.Module, optimizer) -> dict:
        """torch's name-keyed optimizer state with parameter-shaped entries as tp DTensors."""
        sd = super().optimizer_state_dict(self.unwrap(model), optimizer)
        for name, entry in sd["state"].items():
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    entry[k] = self._to_dtensor(name, v)
        return sd

    def load_optimizer_state_dict(self, model: nn.Module, optimizer, state: dict) -> None:
        """Local shards of the loaded DTensors back into the optimizer."""
        for entry in state["state"].values():
            for k, v in entry.items():
                if isinstance(v, DTensor):
                    entry[k] = v.to_local()
        super().load_optimizer_state_dict(self.unwrap(model), optimizer, state)

    def __repr__(self) -> str:
        return f"HybridParallelPlugin(tp_size={self.tp_size}, tp_mode={self.tp_mode!r})"
