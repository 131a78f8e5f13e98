"""Gemini: chunk-based heterogeneous memory (device + host tiers) through ``colossal.gemini``.

Checkpoints are Gemini's own flat slices (``colossal.gemini.sharded_state_dict`` /
``load_sharded_state_dict``), the format every plugin writes: see [Note: ZeRO state in
checkpoints] in ``zero_plugin.py``; nothing is gathered. The gathered, name-keyed
``model_state_dict`` / ``optimizer_state_dict`` remain for exports.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from colossal.comm.knobs import as_bytes, as_count, as_fraction
from colossal.gemini.tiers import CPU_DEFAULT_BUDGET
from colossalai.booster.ddp_plugin import materialize_
from colossalai.booster.plugin import Plugin, materialize_optimizer_state, param_names, rebind_optimizer
from colossalai.booster.precision import Precision
from colossalai.booster.wrappers import EngineBoostedOptimizer
from colossalai.checkpoint.slices import GROUPS_KEY, apply_groups, groups_blob

__all__ = ["GeminiPlugin", "GeminiBoostedOptimizer", "CPU_DEFAULT_BUDGET"]


class GeminiBoostedOptimizer(EngineBoostedOptimizer):
    """The Booster's view of a ``GeminiOptimizer`` (it scales, checks overflow and clips itself)."""

    def __init__(self, gemini_optim) -> None:
        super().__init__(gemini_optim, gemini_optim.optim)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip inside the next ``step()`` over every rank's chunk shards; returns the total norm before
        clipping, as ``torch.nn.utils.clip_grad_norm_`` (collective)."""
        self._clip_next_step(max_grad_norm=float(max_norm), norm_type=float(norm_type))
        return self.engine.grad_norm(float(norm_type))


class GeminiPlugin(Plugin):
    """``GeminiPlugin(placement="auto"|"static", device_memory_budget=bytes)``: parameters, gradients
    and optimizer states in chunks sharded over the data-parallel ranks and placed across device
    and host memory under a byte budget. One model per plugin instance. ``disk_dir=`` (with
    ``host_memory_budget=`` for the auto policy, ``disk_*_frac`` for the static one) adds Gemini's
    disk tier, as ``colossal.gemini.GeminiDDP`` takes it.
    """

    name = "gemini"
    handles_precision = True

    def __init__(
        self,
        *,
        placement: str = "auto",
        device_memory_budget: int | str | None = None,
        chunk_size: int | None = None,
        offload_optim_frac: float = 1.0,
        offload_param_frac: float = 0.0,
        prefetch: int = 2,
        disk_dir: str | None = None,
        host_memory_budget: int | str | None = None,
        disk_param_frac: float = 0.0,
        disk_grad_frac: float = 0.0,
        disk_optim_frac: float = 0.0,
    ) -> None:
        if placement not in ("auto", "static"):
            raise ValueError(f"placement must be 'auto' or 'static', got {placement!r}")
        if device_memory_budget is not None:  # the knobs as GeminiDDP reads them (colossal.comm.knobs)
            device_memory_budget = as_bytes(device_memory_budget, "device_memory_budget")
        if host_memory_budget is not None:
            host_memory_budget = as_bytes(host_memory_budget, "host_memory_budget")
        prefetch = as_count(prefetch, "prefetch")  # chunks gathered ahead (colossal.comm.knobs)
        offload_optim_frac = as_fraction(offload_optim_frac, "offload_optim_frac")
        offload_param_frac = as_fraction(offload_param_frac, "offload_param_frac")
        self.placement, self.budget = placement, device_memory_budget
        self.gemini_kwargs = dict(
            chunk_size=chunk_size,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            prefetch=prefetch,
        )
        if disk_dir is not None:  # the disk tier (colossal.gemini.disk); GeminiDDP checks the settings
            self.gemini_kwargs.update(
                disk_dir=disk_dir,
                host_memory_budget=host_memory_budget,
                disk_param_frac=disk_param_frac,
                disk_grad_frac=disk_grad_frac,
                disk_optim_frac=disk_optim_frac,
            )
        elif host_memory_budget is not None or disk_param_frac or disk_grad_frac or disk_optim_frac:
            raise ValueError(
                "host_memory_budget and disk_*_frac configure Gemini's disk tier: pass disk_dir= too "
                f"(got host_memory_budget={host_memory_budget}, disk_param_frac={disk_param_frac}, "
                f"disk_grad_frac={disk_grad_frac}, disk_optim_frac={disk_optim_frac})"
            )
        self.model = self.engine = None
        self._group_names: list[list[str]] = []

    def configure(self, model: nn.Module, optimizer, precision: Precision):
        """Materialise ``model``, wrap it in ``GeminiDDP`` and the optimizer in ``GeminiOptimizer``."""
        from colossal.gemini import GeminiDDP, GeminiOptimizer

        if optimizer is None:
            raise ValueError("GeminiPlugin needs an optimizer (boost(model, optimizer, ...))")
        if self.model is not None:
            raise ValueError("this GeminiPlugin already manages a model; create one plugin per model")
        names = param_names(model)
        model = materialize_(model, self.device)
        rebind_optimizer(optimizer, names, model)
        current = param_names(model)
        foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in current]
        if foreign:  # Gemini steps only the parameters in its chunks, i.e. the model's
            raise ValueError(
                f"GeminiPlugin: the optimizer holds {len(foreign)} parameter(s) that are not the model's "
                f"(shapes {foreign[:5]}); build it over the model you boost: optimizer(model.parameters())"
            )
        self._group_names = [[current[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        budget = self.budget  # None: GeminiDDP's default (the card's capacity; CPU_DEFAULT_BUDGET on the CPU)
        mp = None if precision is Precision.FP32 else precision.dtype
        with torch.profiler.record_function("colossalai.booster::gemini_wrap"):
            self.model = GeminiDDP(model, placement=self.placement, device_memory_budget=budget, mixed_precision=mp,
                                   device=self.device, **self.gemini_kwargs)  # fmt: skip
            self.engine = GeminiOptimizer(optimizer, self.model)
        return self.model, GeminiBoostedOptimizer(self.engine)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside ``GeminiDDP``."""
        return getattr(model, "module", model)

    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """Gemini accumulates across backward passes by itself (it still reduces each one)."""
        return contextlib.nullcontext()

    # ---- state -------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict:
        """Gathered fp32 parameters keyed by the module's names (collective)."""
        return self.model.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        """Scatter full parameters into Gemini's chunks."""
        self.model.load_state_dict(state)

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full model on every rank. Collective (gathers): every rank calls it."""
        return self.model.state_dict()

    def optimizer_state_dict(self, model: nn.Module, optimizer) -> dict:
        """Gemini's name-keyed optimizer state in the ``torch.distributed.checkpoint`` layout."""
        from colossal.gemini import checkpoint as gemini_checkpoint

        materialize_optimizer_state(self.engine.optim)
        sd = gemini_checkpoint.optimizer_state_dict(self.engine)
        groups = [{**g, "params": names} for g, names in zip(sd["param_groups"], self._group_names, strict=True)]
        return {"state": sd["state"], "param_groups": groups}

    def load_optimizer_state_dict(self, model: nn.Module, optimizer, state: dict) -> None:
        """Inverse of :meth:`optimizer_state_dict` (the loss scaler travels in the run state)."""
        from colossal.gemini import checkpoint as gemini_checkpoint

        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        sd = {"state": state["state"], "param_groups": groups, "loss_scaler": self.engine.scaler.state_dict()}
        gemini_checkpoint.load_optimizer_state_dict(self.engine, sd)

    def checkpoint_pieces(self, model: nn.Module, optimizer=None) -> dict[str, torch.Tensor]:
        """This rank's master slices (and optimizer-state slices), plus the hyperparameters."""
        from colossal.gemini import sharded_state_dict

        if optimizer is None:
            return sharded_state_dict(self.model)
        materialize_optimizer_state(self.engine.optim)
        pieces = sharded_state_dict(self.model, self.engine)
        return {**pieces, GROUPS_KEY: groups_blob(self.engine.optim.param_groups)}

    def model_pieces(self, model: nn.Module, names) -> dict[str, torch.Tensor]:
        """This rank's pieces of the entries ``names``; frozen chunks without one are not read."""
        from colossal.gemini import sharded_state_dict

        return sharded_state_dict(self.model, names=set(names))

    def checkpoint_entries(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
        """Logical shapes and dtypes from Gemini's chunk records (nothing gathered)."""
        from colossal.gemini import sharded_entries

        return {f"model/{n}": e for n, e in sharded_entries(self.model).items()}

    def load_checkpoint_pieces(self, model: nn.Module, optimizer, reader) -> None:
        """Read the pieces overlapping this rank's chunk shards (the loss scaler travels in the run state)."""
        from colossal.gemini import load_sharded_state_dict

        engine = self.engine if optimizer is not None else None
        skip = {k[len("model/") :] for k in reader.skip}
        load_sharded_state_dict(self.model, engine, reader.metadata, reader.load, skip=skip)
        if optimizer is not None:
            apply_groups(self.engine.optim.param_groups, reader.groups())

    def __repr__(self) -> str:
        return f"GeminiPlugin(placement={self.placement!r}, device_memory_budget={self.budget})"
