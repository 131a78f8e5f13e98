"""Plain data parallelism through ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from colossal.comm import mark_unset, unset_names
from colossalai.booster.plugin import Plugin, param_names, rebind_optimizer, world_size
from colossalai.booster.precision import Precision

__all__ = ["TorchDDPPlugin"]


def materialize_(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate a meta-device model on ``device`` (``materialize()`` when the model has one,
    else ``to_empty`` + ``reset_parameters`` per submodule) and move it there.

    Tied tensors stay tied: ``to_empty`` gives every module its own new ``Parameter`` (a meta tensor
    cannot change device in place), so each name that shared a tensor before is pointed back at the
    first name's new one (before ``reset_parameters``, which then initialises the shared tensor).

    A meta tensor keeps no values, so a tensor that no ``reset_parameters()`` (nor a Hugging Face
    model's ``_init_weights``) initialises would train on whatever memory ``to_empty`` handed it:
    every tensor is marked first and a :class:`ValueError` names those still marked."""
    if any(p.is_meta for p in model.parameters()):
        ties = _tied_names(model)
        if hasattr(model, "materialize"):
            model.materialize(device)
            _retie(model, ties)
        else:
            model.to_empty(device=device)
            _retie(model, ties)
            mark_unset(itertools.chain(model.parameters(), model.buffers()))  # [Note: marking tensors ...]
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            _model_init(model)
            unset = unset_names(itertools.chain(model.named_parameters(), model.named_buffers()))
            if unset:
                raise ValueError(
                    f"meta-device model: {', '.join(unset)} not initialised by any reset_parameters() or "
                    "the model's _init_weights (a meta tensor keeps no values: a buffer such as "
                    "torch.ones(n) built under torch.device('meta') is lost); give the model a "
                    "materialize(device) method, give those modules reset_parameters(), or build the model "
                    "on a real device"
                )
    return model.to(device)


def _model_init(model: nn.Module) -> bool:
    """Run a Hugging Face model's own initialiser (``_init_weights``, each module after its children,
    as ``transformers`` does) on every module that holds no meta tensor (a pipeline rank's other
    stages stay meta); ``False`` when the model has none. ``to_empty`` leaves modules without
    ``reset_parameters`` (GPT-2's ``Conv1D``, RMSNorm) and non-persistent buffers (BERT's
    ``position_ids``) uninitialised, and the model's distributions (std ``initializer_range``) are
    not ``reset_parameters``' anyway."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return False
    with torch.no_grad():
        for module in reversed(list(model.modules())):
            tensors = [*module.parameters(), *module.buffers()]
            if tensors and not any(t.is_meta for t in tensors):
                init(module)
    return True


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Names of every parameter or buffer reachable under several names, grouped, first name first."""
    groups: dict[int, list[str]] = {}
    named = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Point every name of each group at the tensor its first name now holds."""
    for first, *rest in ties:
        owner, attr = _owner(model, first)
        shared = getattr(owner, attr)
        for name in rest:
            setattr(*_owner(model, name), shared)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


class TorchDDPPlugin(Plugin):
    """Every rank holds the whole model; gradients are all-reduced in buckets during backward.

    With a world size of 1 the model is not wrapped at all (no DDP overhead). Parameters of rank 0
    are broadcast at wrap time, so ranks start identical whatever their seeds.
    """

    name = "ddp"

    def __init__(
        self,
        *,
        bucket_cap_mb: int = 25,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.ddp_kwargs = dict(
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        if not broadcast_buffers:  # passed only when changed: newer torch deprecates the argument
            self.ddp_kwargs["broadcast_buffers"] = False

    def configure(self, model: nn.Module, optimizer, precision: Precision):
        """Move ``model`` to this rank's device (materialising meta tensors) and wrap it in DDP."""
        names = param_names(model)
        model = materialize_(model, self.device)
        rebind_optimizer(optimizer, names, model)
        if world_size() > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            with torch.profiler.record_function("colossalai.booster::ddp_wrap"):
                model = DDP(model, device_ids=ids, **self.ddp_kwargs)
        return model, optimizer

    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """DDP's own ``no_sync`` (a no-op without DDP)."""
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Strip the DDP wrapper."""
        return model.module if isinstance(model, DDP) else model
