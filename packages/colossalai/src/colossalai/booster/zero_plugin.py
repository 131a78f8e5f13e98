"""ZeRO stages 1-3 (with optional CPU offload) through ``colossal.zero.ZeroOptimizer``.

[Note: ZeRO state in checkpoints]
``colossal.zero`` shards flat buffers whose ranges cross parameter boundaries, so its shards are
not DTensors. Checkpoints use the flat-slice format ([Note: flat-slice checkpoints] in
:mod:`colossalai.checkpoint.slices`), which is ZeRO's own sharded layout: each rank hands DCP
views of its own slices (``engine.sharded_state_dict()``) and, to load, reads only the pieces that
overlap them (``engine.load_sharded_state_dict``), whatever plugin and world size wrote them. No
rank gathers the model or the optimizer state. ``model_state_dict`` / ``optimizer_state_dict``
(gathered, name-keyed, the ``torch.distributed.checkpoint.state_dict`` layout) remain for exports
and for the hybrid plugin's tensor-parallel ZeRO.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from colossalai.booster.ddp_plugin import materialize_
from colossalai.booster.plugin import (
    Plugin,
    ensure_process_group,
    materialize_optimizer_state,
    param_names,
    rebind_optimizer,
)
from colossalai.booster.precision import Precision
from colossalai.booster.wrappers import EngineBoostedOptimizer
from colossalai.checkpoint.slices import GROUPS_KEY, apply_groups, groups_blob

__all__ = ["ZeroPlugin", "ZeroBoostedOptimizer", "zero_optimizer_state", "load_zero_optimizer"]


class ZeroBoostedOptimizer(EngineBoostedOptimizer):
    """The Booster's view of a ``ZeroOptimizer``: it scales, unscales, checks overflow and clips itself."""

    def __init__(self, zero) -> None:
        super().__init__(zero, zero.optimizer)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip inside the next ``step()`` (the norm spans every rank's shards); returns the total norm
        before clipping, as ``torch.nn.utils.clip_grad_norm_`` (collective)."""
        if norm_type != 2.0:
            raise NotImplementedError(f"ZeroPlugin clips the 2-norm only, got norm_type={norm_type}")
        self._clip_next_step(max_grad_norm=float(max_norm))
        return self.engine.grad_norm(2.0)

    @property
    def engine_clip_target(self):
        """ZeRO keeps its clip setting in its config."""
        return self.engine.config


class ZeroPlugin(Plugin):
    """``ZeroPlugin(stage=2, offload=False)``: optimizer states (1), + gradients (2), + parameters
    (3) sharded over the data-parallel ranks (the whole world); ``offload`` keeps fp32 master
    shards, gradients and optimizer states on the CPU (``offload_optim_frac=`` a fraction of them,
    as ``GeminiPlugin`` takes it); ``prefetch`` units gathered ahead under stage 3. Mixed precision
    is ZeRO's own (fp16 with its dynamic loss scaler, or bf16). One model per plugin instance.
    """

    name = "zero"
    handles_precision = True
    owns_model_state = True  # the masters (and stage 3's freed parameters) are ZeRO's: BoostedModel asks it

    def __init__(
        self,
        *,
        stage: int = 2,
        offload: bool = False,
        offload_optim_frac: float | None = None,
        bucket_numel: int = 2**22,
        prefetch: int = 1,
    ):
        from colossal.zero import ZeroConfig

        # ZeroConfig checks every knob here, before any process group: the same names, types and
        # messages as ZeroOptimizer (offload_optim_frac and prefetch as GeminiPlugin takes them)
        cfg = ZeroConfig(stage=stage, offload=offload, offload_optim_frac=offload_optim_frac,
                         bucket_numel=bucket_numel, prefetch=prefetch)  # fmt: skip
        self.offload_optim_frac = cfg.offload_fraction
        self.stage, self.offload = stage, self.offload_optim_frac == 1.0
        self.zero_kwargs = dict(bucket_numel=bucket_numel, prefetch=cfg.prefetch)
        self.engine = None
        self._index_names: list[str] = []

    def configure(self, model: nn.Module, optimizer, precision: Precision):
        """Materialise ``model`` on this rank's device and hand it with ``optimizer`` to ZeRO."""
        from colossal.zero import ZeroOptimizer

        if optimizer is None:
            raise ValueError("ZeroPlugin needs an optimizer to shard (boost(model, optimizer, ...))")
        ensure_process_group("ZeroPlugin")  # a plain single process gets a world of one
        if self.engine is not None:
            raise ValueError("this ZeroPlugin already manages a model; create one plugin per model")
        names = param_names(model)
        model = materialize_(model, self.device)
        rebind_optimizer(optimizer, names, model)
        current = param_names(model)
        self._index_names = [current[id(p)] for g in optimizer.param_groups for p in g["params"]]
        with torch.profiler.record_function("colossalai.booster::zero_wrap"):
            self.engine = ZeroOptimizer(
                optimizer,
                model,
                stage=self.stage,
                offload_optim_frac=self.offload_optim_frac,
                param_dtype=precision.dtype,
                **self.zero_kwargs,
            )
        return model, ZeroBoostedOptimizer(self.engine)

    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """ZeRO's gradient accumulation context."""
        return self.engine.no_sync()

    # ---- state: gathered, name-keyed (see the module note) ---------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict:
        """Full fp32 parameters (and buffers) keyed by name. Collective (gathers): every rank calls it."""
        return self.engine.full_model_state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        """Scatter full parameters into ZeRO's shards."""
        self.engine.load_full_model_state_dict(state)

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full model on every rank (rank 0 writes exports). Collective: every rank calls it."""
        return self.engine.full_model_state_dict()

    def load_full_model_state_dict(self, model: nn.Module, state: dict, *, strict: bool = True):
        """A plain (full) state dict into ZeRO's masters and working parameters, strict like
        ``torch.nn.Module.load_state_dict``; returns torch's ``_IncompatibleKeys``. Every rank calls it."""
        return self.engine.load_full_model_state_dict(state, strict=strict)

    def optimizer_state_dict(self, model: nn.Module, optimizer) -> dict:
        """ZeRO's gathered optimizer state re-keyed from indices to parameter names."""
        return zero_optimizer_state(self.engine, self._index_names)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer, state: dict) -> None:
        """Inverse of :meth:`optimizer_state_dict` (the loss scaler travels in the run state)."""
        load_zero_optimizer(self.engine, self._index_names, state)

    def checkpoint_pieces(self, model: nn.Module, optimizer=None) -> dict[str, torch.Tensor]:
        """ZeRO's own slices (see the module note) and the optimizer's hyperparameters."""
        if optimizer is None:
            return self.engine.sharded_state_dict(include_optimizer=False)
        materialize_optimizer_state(self.engine.optimizer)
        return {**self.engine.sharded_state_dict(), GROUPS_KEY: groups_blob(self.engine.optimizer.param_groups)}

    def checkpoint_entries(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
        """Logical shapes and dtypes from ZeRO's buffers (nothing gathered)."""
        return {f"model/{n}": e for n, e in self.engine.sharded_entries().items()}

    def load_checkpoint_pieces(self, model: nn.Module, optimizer, reader) -> None:
        """Read the pieces overlapping this rank's slices (the loss scaler travels in the run state)."""
        skip = {k[len("model/") :] for k in reader.skip}
        self.engine.load_sharded_state_dict(
            reader.metadata, reader.load, include_optimizer=optimizer is not None, skip=skip
        )
        if optimizer is not None:
            apply_groups(self.engine.optimizer.param_groups, reader.groups())

    def __repr__(self) -> str:
        if self.offload or not self.offload_optim_frac:
            return f"ZeroPlugin(stage={self.stage}, offload={self.offload})"
        return f"ZeroPlugin(stage={self.stage}, offload_optim_frac={self.offload_optim_frac})"


def zero_optimizer_state(engine, names: list[str]) -> dict:
    """ZeRO's gathered optimizer state re-keyed from parameter indices to ``names``."""
    materialize_optimizer_state(engine.optimizer)
    sd = engine.state_dict()
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def load_zero_optimizer(engine, names: list[str], state: dict) -> None:
    """Inverse of :func:`zero_optimizer_state`."""
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    engine.load_state_dict({"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups})
