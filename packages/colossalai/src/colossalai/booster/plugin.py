"""The plugin interface: how a parallel layout turns a model, optimizer and data into boosted ones.

A plugin owns three things: wrapping (``configure``), data sharding (``prepare_dataloader``, over
its data-parallel axis), and state (model/optimizer state dicts keyed by the *original* parameter
names, so that checkpoints move between plugins and world sizes through
``torch.distributed.checkpoint``). Everything else (loss scaling, autocast, checkpoint files) is
the Booster's, so a plugin stays small.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_sd
from torch import nn
from torch.utils.data import DataLoader, Dataset

from colossal.comm import ensure_process_group
from colossalai.booster.precision import Precision
from colossalai.checkpoint.slices import aliases, fill_state, model_entries, pieces_from_state
from colossalai.data.dataset import ResumableDistributedSampler

__all__ = [
    "Plugin",
    "world_size",
    "world_rank",
    "param_names",
    "rebind_optimizer",
    "materialize_optimizer_state",
    "ensure_process_group",
]


def world_size() -> int:
    """World size of the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def world_rank() -> int:
    """Global rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_initialized() else 0


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (every alias of a tied parameter maps to its first name)."""
    return {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def rebind_optimizer(optimizer: torch.optim.Optimizer | None, names: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer`` at ``model``'s current parameters, matched by name.

    Materialising a meta model (or sharding it) replaces its ``Parameter`` objects; an optimizer
    built over the old ones is rebound here. Must run before the optimizer has state.
    """
    if optimizer is None:
        return
    current = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] if id(p) in names else p for p in group["params"]]


class Plugin(abc.ABC):
    """Base class of every Booster plugin."""

    name: str = "plugin"
    """Short name used by the CLI (``--plugin NAME``)."""
    owns_model_state: bool = False
    """Whether the real values live in the engine rather than the module's tensors (ZeRO): then the
    boosted model's ``state_dict`` is :meth:`full_model_state_dict` and its ``load_state_dict``
    calls ``load_full_model_state_dict(model, state, strict=)``."""
    supported_precisions: tuple[Precision, ...] = (Precision.FP32, Precision.FP16, Precision.BF16)
    """Precisions :meth:`configure` accepts."""
    handles_precision: bool = False
    """True when the plugin's engine does its own loss scaling/casting (the Booster then does not)."""

    @abc.abstractmethod
    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Wrap ``model`` (and ``optimizer``); return the wrapped pair."""

    @property
    def device(self) -> torch.device:
        """The compute device of this rank."""
        from colossal.comm import default_device

        return default_device()

    # ---- data ------------------------------------------------------------------------------
    def dp_size(self) -> int:
        """Number of data-parallel replicas (default: the whole world)."""
        return world_size()

    def dp_rank(self) -> int:
        """This rank's index on the data-parallel axis."""
        return world_rank()

    def prepare_dataloader(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, **kwargs
    ) -> DataLoader:
        """A DataLoader whose sampler gives this rank its share of the data-parallel axis.

        ``batch_size`` is per data-parallel rank; the sampler drops the ragged tail so that every
        rank runs the same number of steps, and can resume mid-epoch
        (:class:`~colossalai.data.ResumableDistributedSampler`).
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        sampler = ResumableDistributedSampler(
            dataset, num_replicas=self.dp_size(), rank=self.dp_rank(), shuffle=shuffle, seed=seed
        )
        kwargs.setdefault("drop_last", True)
        # Without a generator of its own, every iter(loader) draws from the global torch RNG, so a
        # resumed run (one more iter() after the RNG was restored) drifts from an uninterrupted one.
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **kwargs)

    # ---- training-step hooks -----------------------------------------------------------------
    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """Context in which backward passes accumulate gradients without communication."""
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the plugin's wrapper."""
        return model

    # ---- state (keys are the original module's parameter names) -------------------------------
    def model_state_dict(self, model: nn.Module) -> dict:
        """Sharded-or-full model state for ``torch.distributed.checkpoint`` (canonical names).
        May be collective (a plugin that gathers): call on every rank."""
        return dcp_sd.get_model_state_dict(model)

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        """Load what :meth:`model_state_dict` produced (possibly resharded by DCP)."""
        dcp_sd.set_model_state_dict(model, state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Optimizer state keyed by parameter names, for ``torch.distributed.checkpoint``.
        May be collective (a plugin that gathers): call on every rank."""
        return dcp_sd.get_optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what :meth:`optimizer_state_dict` produced. A parameter without an entry is left
        without state (``torch.optim``'s rule; DCP's own strict check would refuse it), but an
        entry for no parameter of the model is a ``ValueError`` naming it."""
        known = set(dict(self.unwrap(model).named_parameters(remove_duplicate=False)))
        unknown = sorted(n for n in state.get("state", {}) if n not in known)
        if unknown:
            raise ValueError(f"optimizer state for {unknown}, which are not parameters of the model")
        dcp_sd.set_optimizer_state_dict(model, optimizer, state, options=dcp_sd.StateDictOptions(strict=False))

    # ---- checkpoints: the flat-slice format ([Note: flat-slice checkpoints]) ------------------------
    def checkpoint_pieces(self, model: nn.Module, optimizer=None) -> dict[str, torch.Tensor]:
        """This rank's pieces of a checkpoint (``model/<name>@<start>``, ``optim/<name>/<key>@<start>``,
        ...; :mod:`colossalai.checkpoint.slices`). Default: from :meth:`model_state_dict` and
        :meth:`optimizer_state_dict` (whole tensors; a DTensor gives its local block).
        Collective like every checkpoint step: every rank calls it."""
        optim_sd = self.optimizer_state_dict(model, optimizer) if optimizer is not None else None
        return pieces_from_state(self.model_state_dict(model), optim_sd, aliases(self.unwrap(model)))

    def model_pieces(self, model: nn.Module, names) -> dict[str, torch.Tensor]:
        """This rank's pieces (``model/<name>@<start>``, as :meth:`checkpoint_pieces` gives them) of
        the model entries ``names`` only: what a partial save (a LoRA adapter) gathers. Default:
        :meth:`checkpoint_pieces` filtered. Collective (as that is): every rank calls it."""
        wanted = {f"model/{n}" for n in names}
        return {k: v for k, v in self.checkpoint_pieces(model).items() if k.rpartition("@")[0] in wanted or k in wanted}

    def checkpoint_entries(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
        """``model/<name> -> (logical shape, dtype name)`` of every model entry a checkpoint holds
        (parameters and persistent buffers, tied names once): recorded at save, checked at load
        ([Note: strict loading] in :mod:`colossalai.checkpoint.entries`). Default: from
        :meth:`model_state_dict` (a DTensor has its global shape)."""
        return model_entries(self.model_state_dict(model), aliases(self.unwrap(model)))

    def load_checkpoint_pieces(self, model: nn.Module, optimizer, reader) -> None:
        """Load model (and optimizer) from a :class:`~colossalai.checkpoint.SliceReader`, reading
        only the pieces overlapping this rank's tensors and leaving ``reader.skip`` (a non-strict
        load's missing entries) alone. Default: fills the templates of
        :meth:`model_state_dict` / :meth:`optimizer_state_dict`, then loads them."""
        model_sd = self.model_state_dict(model)
        optim_sd = self.optimizer_state_dict(model, optimizer) if optimizer is not None else None
        fill_state(reader, model_sd, optim_sd, aliases(self.unwrap(model)))
        self.load_model_state_dict(model, model_sd)
        if optimizer is not None:
            self.load_optimizer_state_dict(model, optimizer, optim_sd)

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model, unsharded, on the CPU of rank 0 (other ranks may get an empty dict).
        Collective: every rank calls it (rank 0 then writes)."""
        options = dcp_sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dcp_sd.get_model_state_dict(model, options=options)

    def named_parameters_for_clip(self, model: nn.Module) -> Iterator[torch.Tensor]:
        """Parameters whose gradients ``clip_grad_norm`` acts on."""
        return iter(model.parameters())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a never-stepped optimizer its state tensors with a zero-gradient, zero-lr step, so
    that ``torch.distributed.checkpoint`` knows what to load into; parameters do not change."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None
