"""The Booster: one call turns a plain PyTorch training setup into a distributed one.

```python
booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")
model, optimizer, criterion, dataloader, scheduler = booster.boost(model, optimizer, criterion, dataloader, scheduler)
for x, y in dataloader:
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)      # instead of loss.backward()
    optimizer.step(); optimizer.zero_grad()
```

[Note: MoE auxiliary losses]
A model with ``colossal.moe.MoE`` layers (``colossalai.models.build_moe_gpt``, or a user's model
holding them) keeps each layer's weighted load-balancing and z-loss from its last forward. With
``Booster(moe_aux_loss=True)`` (the default) ``boost`` returns the criterion wrapped in
:class:`MoEAuxLoss` (``criterion(out, y) + colossal.moe.moe_aux_loss(model)``) and
``execute_pipeline`` wraps whatever criterion it is given the same way (never twice), so the
training loss includes them under every plugin. ``moe_aux_loss=False``: the criterion is left as
it is and the user adds ``model.unwrap().aux_loss()`` (or ``moe_aux_loss``) to the loss.
Under pipeline parallelism the last stage's criterion cannot see the other stages' layers, so the
aux losses are added *per stage* instead: the plugin attaches each MoE layer's aux loss of each
micro-batch to that layer's output (``colossal.moe.attach_aux_loss``, weight ``1 / m`` for ``m``
micro-batches, times the fp16 loss scale), so the stage's backward of the micro-batch
backpropagates it, and ``execute_pipeline`` returns the criterion's loss plus every stage's aux
losses (summed over pp): the same loss and gradients as ``criterion + moe_aux_loss`` over the
micro-batches of one process. ``moe_aux_loss=False`` leaves the pipeline's loss alone there too.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import torch
import torch.distributed as dist
from torch import nn

from colossalai.booster import lora
from colossalai.booster.ddp_plugin import TorchDDPPlugin
from colossalai.booster.plugin import Plugin, world_rank
from colossalai.booster.precision import Precision, parse_precision
from colossalai.booster.wrappers import BoostedModel, BoostedOptimizer
from colossalai.checkpoint import (
    DEFAULT_ARRIVAL_TIMEOUT,
    IncompatibleEntries,
    arrival_checked,
    atomic_checkpoint_dir,
    check_all_ranks_arrive,
    load_run_file,
    load_sharded,
    read_rng,
    resolve_checkpoint,
    restore_rng,
    save_run_files,
    save_safetensors_folder,
    save_sharded,
)
from colossalai.checkpoint.hf import folder_names, load_pretrained, parse_shard_size, save_pretrained
from colossalai.checkpoint.integrity import load_file_checked
from colossalai.checkpoint.sharded import open_checkpoint, quiet_single_process
from colossalai.checkpoint.slices import aliases

__all__ = ["Booster", "MoEAuxLoss", "RunState"]


@dataclasses.dataclass(kw_only=True, slots=True)
class RunState:
    """Where a training run stood when it was saved."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current data epoch."""
    consumed_samples: int = 0
    """Global samples consumed in the current epoch (see ``ResumableDistributedSampler``)."""
    extra: dict = dataclasses.field(default_factory=dict)
    """Whatever the caller stored (config, metrics, ...)."""


def _has_moe(model: nn.Module) -> bool:
    from colossal.moe import moe_layers

    return bool(moe_layers(model))


class MoEAuxLoss:
    """``criterion(*args) + colossal.moe.moe_aux_loss(model)``: the task loss plus the weighted
    auxiliary losses of the model's MoE layers from the last forward (``[Note: MoE auxiliary losses]``)."""

    def __init__(self, criterion, model: nn.Module) -> None:
        self.criterion, self.model = criterion, model

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """The criterion's loss plus the auxiliary losses (none before the first forward)."""
        from colossal.moe import moe_aux_loss

        loss = self.criterion(*args, **kwargs)
        aux = moe_aux_loss(self.model)
        return loss if aux is None else loss + aux.to(loss.dtype)


def _pretrained_config(owner: nn.Module, config):
    """``config``, or ``owner``'s own ``config`` when that is a ``transformers`` one (a user's model
    may have another kind: the folder then has no ``config.json``); TypeError for a given config
    without ``save_pretrained``."""
    if config is None:
        config = getattr(owner, "config", None)
        return config if hasattr(config, "save_pretrained") else None
    if not hasattr(config, "save_pretrained"):
        raise TypeError(
            f"config must have save_pretrained (a transformers PretrainedConfig), got {type(config).__name__}"
        )
    return config


class Booster:
    """Applies a plugin (parallel layout) and a mixed-precision mode to a training setup.

    ``checkpoint_timeout``: seconds every save/load waits for all ranks to call it before it raises
    a :class:`~colossalai.checkpoint.CheckpointError` naming the ranks that did not ([Note: the
    arrival check] in :mod:`colossal.comm.arrival`).

    ``moe_aux_loss``: add the MoE layers' auxiliary losses to the criterion's loss (see
    ``[Note: MoE auxiliary losses]``); ignored for a model without MoE layers.
    """

    def __init__(
        self,
        plugin: Plugin | None = None,
        mixed_precision: str | torch.dtype | Precision | None = None,
        *,
        checkpoint_timeout: float = DEFAULT_ARRIVAL_TIMEOUT,
        moe_aux_loss: bool = True,
    ) -> None:
        if not isinstance(moe_aux_loss, bool):
            raise TypeError(f"moe_aux_loss must be a bool, got {moe_aux_loss!r}")
        self.moe_aux_loss = moe_aux_loss
        self._moe_model: nn.Module | None = None  # the user's model when its aux losses are added
        if checkpoint_timeout <= 0:
            raise ValueError(f"checkpoint_timeout must be a positive number of seconds, got {checkpoint_timeout}")
        self.checkpoint_timeout = float(checkpoint_timeout)
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a colossalai Plugin, got {type(plugin).__name__}")
        self.plugin = plugin or TorchDDPPlugin()
        self.precision = parse_precision(mixed_precision)
        if self.precision not in self.plugin.supported_precisions:
            supported = [p.value for p in self.plugin.supported_precisions]
            raise NotImplementedError(f"{self.plugin!r} supports mixed_precision in {supported}, got {self.precision}")

    def boost(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        """Return ``(model, optimizer, criterion, dataloader, lr_scheduler)``, boosted.

        The optimizer must have been built over ``model.parameters()``; the scheduler over that
        optimizer. A meta-device model is materialised by the plugin and the optimizer rebound
        (by parameter name). One model per Booster.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        with torch.profiler.record_function("colossalai.booster::configure"):
            wrapped, optimizer = self.plugin.configure(model, optimizer, self.precision)
        original = self.plugin.unwrap(wrapped)
        if self.moe_aux_loss and _has_moe(original) and getattr(self.plugin, "pp_size", 1) > 1:
            self.plugin.add_moe_aux_losses(original)  # per stage (the note)
        elif self.moe_aux_loss and _has_moe(original):
            self._moe_model = original
            criterion = MoEAuxLoss(criterion, original) if criterion is not None else None
        # A plugin whose engine casts and scales itself gets no autocast and no loss scaler here.
        precision = Precision.FP32 if self.plugin.handles_precision else self.precision
        boosted_model = BoostedModel(wrapped, original, precision, self.plugin.device, plugin=self.plugin)
        if optimizer is not None and not isinstance(optimizer, BoostedOptimizer):
            optimizer = BoostedOptimizer(optimizer, self._make_scaler())
        if optimizer is not None:
            optimizer.boosted_model = boosted_model
        return boosted_model, optimizer, criterion, dataloader, lr_scheduler

    def _make_scaler(self):
        if self.precision is not Precision.FP16 or self.plugin.handles_precision:
            return None
        from colossal.optim import DynamicLossScaler

        return DynamicLossScaler()

    # ---- the training step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer) -> None:
        """Backward pass through the optimizer (scales the loss in fp16)."""
        optimizer.backward(loss)

    def execute_pipeline(self, batch, model: BoostedModel, criterion, optimizer: BoostedOptimizer) -> torch.Tensor:
        """One forward and backward of ``batch = (x, y)``: ``criterion(model(x), y)`` then
        :meth:`backward`, or, with a pipeline-parallel plugin (``pp_size > 1``), all micro-batches
        through the pipeline schedule. Returns the (detached) loss; the caller then clips and
        steps as usual. Works with every plugin, so one training loop serves all of them.
        The loss includes the MoE auxiliary losses (``[Note: MoE auxiliary losses]``). A Hugging
        Face model takes ``x`` as a dict of its inputs (``input_ids``, ``attention_mask``, ...;
        called ``model(**x)``) and ``criterion`` gets the output's ``logits``, under every plugin
        (pipeline parallelism: see ``HybridParallelPlugin.execute_pipeline``)."""
        x, y = batch
        if self._moe_model is not None and not isinstance(criterion, MoEAuxLoss):
            criterion = MoEAuxLoss(criterion, self._moe_model)
        if getattr(self.plugin, "pp_size", 1) > 1:
            return self.plugin.execute_pipeline(model.module, x, y, criterion)
        out = model(**x) if isinstance(x, dict) else model(x)  # a dict: a Hugging Face model's keyword inputs
        loss = criterion(getattr(out, "logits", out), y)  # a transformers ModelOutput: its logits
        del out  # the logits (B, T, V) need not live through backward: the criterion saved what it needs
        self.backward(loss, optimizer)
        return loss.detach()

    def no_sync(self, model: BoostedModel, optimizer: BoostedOptimizer | None = None):
        """Context for gradient accumulation: backward passes inside it do not communicate."""
        inner = model.module if isinstance(model, BoostedModel) else model
        return self.plugin.no_sync(inner, optimizer)

    def clip_grad_norm(self, optimizer: BoostedOptimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients (unscaled first in fp16) to ``max_norm``; returns the total norm."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        return optimizer.clip_grad_norm(max_norm, norm_type)

    def prepare_dataloader(self, dataset, batch_size: int, **kwargs):
        """The plugin's distributed DataLoader (see :meth:`Plugin.prepare_dataloader`)."""
        return self.plugin.prepare_dataloader(dataset, batch_size, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------------
    # [Note: checkpoints are collective] Every save_* / load_* / export_* below is a collective:
    # call it on every rank with the same arguments, never under ``if rank == 0:``. Each first
    # checks that all ranks arrived ([Note: the arrival check] in colossal.comm.arrival) and
    # raises a CheckpointError naming the missing ranks after ``checkpoint_timeout`` seconds.
    def _arrive(self, op: str) -> None:
        check_all_ranks_arrive(f"Booster.{op}", self.checkpoint_timeout)

    def save_model(self, model: BoostedModel, root: str | os.PathLike, name: str = "model") -> pathlib.Path:
        """Sharded, crash-safe model checkpoint ``root/name`` (DCP); returns its path.
        Collective: every rank calls it (each writes its own shard)."""
        self._arrive("save_model")
        with atomic_checkpoint_dir(root, name) as tmp:
            save_sharded(tmp, self.plugin, model.module)
        return pathlib.Path(root) / name

    def load_model(self, model: BoostedModel, path: str | os.PathLike, *, strict: bool = True) -> IncompatibleEntries:
        """Load a model checkpoint written by any plugin at any world size. Collective.

        Strict like ``load_state_dict``: one :class:`~colossalai.checkpoint.CheckpointMismatchError`
        lists every missing, unexpected and mis-shaped entry, on every rank, before anything
        changes; with ``strict=False`` the missing ones stay as they are and the unexpected ones
        are ignored, and both come back as :class:`~colossalai.checkpoint.IncompatibleEntries`
        (mis-shaped entries are always an error). A damaged file raises
        :class:`~colossalai.checkpoint.CheckpointError` naming it.

        A model boosted after :meth:`enable_lora` loads a checkpoint of its base model too (one
        written without LoRA): the base weights are read into the adapted layers and the adapter
        is left as it is ([Note: a base checkpoint into a LoRA model] in ``booster/lora.py``).
        """
        self._arrive("load_model")
        path = resolve_checkpoint(path)
        reader = None
        if lora.is_peft_model(self.plugin.unwrap(model.module)):  # [Note: a base checkpoint into a LoRA model]
            with quiet_single_process():
                reader = open_checkpoint(path)
                if lora.holds_base_names(reader.entries()):
                    return lora.load_base(self.plugin, model.module, reader, strict=strict)
        return load_sharded(path, self.plugin, model.module, strict=strict, reader=reader)

    def save_optimizer(self, optimizer: BoostedOptimizer, root: str | os.PathLike, name: str = "optimizer"):
        """Sharded, crash-safe model + optimizer checkpoint (optimizer state is keyed by parameter
        name). Collective: every rank calls it."""
        self._arrive("save_optimizer")
        with atomic_checkpoint_dir(root, name) as tmp:
            save_sharded(tmp, self.plugin, optimizer.boosted_model.module, optimizer.unwrap())
        return pathlib.Path(root) / name

    def load_optimizer(
        self, optimizer: BoostedOptimizer, path: str | os.PathLike, *, strict: bool = True
    ) -> IncompatibleEntries:
        """Load model and optimizer state from :meth:`save_optimizer` or :meth:`save_run`.
        Collective; strict as :meth:`load_model` (optimizer state may be absent for a parameter,
        as torch's optimizers hold none for one that never had a gradient)."""
        self._arrive("load_optimizer")
        module = optimizer.boosted_model.module
        return load_sharded(resolve_checkpoint(path), self.plugin, module, optimizer.unwrap(), strict=strict)

    def optimizer_state_dict(self, optimizer: BoostedOptimizer) -> dict:
        """The whole optimizer state on every rank, in the layout of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for the plain model:
        ``{"state": {name: entry}, "param_groups": [{..., "params": [names]}]}``, under the user's
        parameter names (a tied parameter under its first name). torch's contract holds on every
        plugin: a parameter that never had a gradient has no entry, every entry has its ``step``
        with its moments, each group keeps its own hyperparameters. Collective (the sharded
        plugins gather): every rank calls it."""
        self._arrive("optimizer_state_dict")
        return self.plugin.optimizer_state_dict(optimizer.boosted_model.module, optimizer.unwrap())

    def load_optimizer_state_dict(self, optimizer: BoostedOptimizer, state: dict) -> None:
        """Load what :meth:`optimizer_state_dict` gives (from any plugin and world size, or from a
        plain model's ``get_optimizer_state_dict``); a parameter without an entry is left without
        state, as ``torch.optim.Optimizer.load_state_dict`` leaves it. Every rank calls it with
        the whole state."""
        self._arrive("load_optimizer_state_dict")
        self.plugin.load_optimizer_state_dict(optimizer.boosted_model.module, optimizer.unwrap(), state)

    def save_lr_scheduler(self, lr_scheduler, path: str | os.PathLike) -> None:
        """``torch.save`` of the scheduler state (rank 0 writes; it is identical on every rank)."""
        if world_rank() == 0:
            torch.save(lr_scheduler.state_dict(), path)

    def load_lr_scheduler(self, lr_scheduler, path: str | os.PathLike) -> None:
        """Inverse of :meth:`save_lr_scheduler` (a damaged file raises CheckpointError naming it)."""
        state = load_file_checked(path, "the LR scheduler state", lambda p: torch.load(p, weights_only=False))
        lr_scheduler.load_state_dict(state)

    def save_run(self, root, model, optimizer, lr_scheduler=None, *, state: RunState, name: str | None = None):
        """Everything needed for an exact resume, as ``root/step-XXXXXXXX``; ``root/latest`` points at it.

        Model and optimizer go through DCP (reshardable); step, data position, scheduler, loss
        scaler and extras go to ``run_state.pt``; each rank's RNG states to ``rng/rank<r>.pt``.
        Collective: every rank calls it.
        """
        self._arrive("save_run")
        name = name or f"step-{state.step:08d}"
        with atomic_checkpoint_dir(root, name) as tmp:
            save_sharded(tmp, self.plugin, model.module, optimizer.unwrap())
            payload = self._run_payload(optimizer, lr_scheduler, state) if world_rank() == 0 else None
            save_run_files(tmp, payload)
        return pathlib.Path(root) / name

    def _run_payload(self, optimizer, lr_scheduler, state: RunState) -> dict:
        return {
            "run": dataclasses.asdict(state),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "scaler": optimizer.scaler.state_dict() if getattr(optimizer, "scaler", None) else None,
            "plugin": type(self.plugin).__name__,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }

    def load_run(self, path, model, optimizer, lr_scheduler=None, dataloader=None) -> RunState:
        """Restore a :meth:`save_run` checkpoint (``path`` may be the root: ``latest`` is used).

        With ``dataloader`` (from :meth:`prepare_dataloader`) its sampler resumes at the saved
        data position. Returns the saved :class:`RunState`. Collective and strict (see
        :meth:`load_model`); every file is checked before anything changes.
        """
        self._arrive("load_run")
        path = resolve_checkpoint(path)
        payload, rng = load_run_file(path), read_rng(path)  # read (and checked) before anything changes
        load_sharded(path, self.plugin, model.module, optimizer.unwrap())
        if lr_scheduler is not None and payload["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(payload["lr_scheduler"])
        if getattr(optimizer, "scaler", None) is not None and payload["scaler"] is not None:
            optimizer.scaler.load_state_dict(payload["scaler"])
        state = RunState(**payload["run"])
        if dataloader is not None and hasattr(dataloader.sampler, "set_position"):
            dataloader.sampler.set_position(state.epoch, state.consumed_samples)
        restore_rng(rng)
        return state

    def export_safetensors(self, model: BoostedModel, folder, max_shard_bytes: int = 2 * 1024**3):
        """Gather the full model and write a Hugging Face style safetensors folder (rank 0 writes).
        Collective: every rank calls it (the gather needs them all)."""
        with arrival_checked("Booster.export_safetensors", self.checkpoint_timeout):  # the engine's gathers inside
            full = self.plugin.full_model_state_dict(model.module)
        if world_rank() == 0:
            save_safetensors_folder(full, folder, max_shard_bytes)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return pathlib.Path(folder)

    # ---- Hugging Face folders ([Note: a safetensors folder as a flat-slice checkpoint]) ----------
    def load_pretrained(self, model: BoostedModel, folder: str | os.PathLike, *, strict: bool = True):
        """Load a Hugging Face ``save_pretrained`` folder (``model.safetensors``, or shards plus
        ``model.safetensors.index.json``; read locally, never downloaded) into a boosted model,
        under any plugin and world size: each rank reads only the slices it owns.

        Build the model from its config (``AutoModelForCausalLM.from_config(config)``, on the meta
        device for a large one), boost it, then load. Names match as in ``from_pretrained`` (tied
        weights saved once, a base model's folder into a model with a head, the model's
        ``_keys_to_ignore_on_load_*`` patterns); otherwise strict like :meth:`load_model`: one
        :class:`~colossalai.checkpoint.CheckpointMismatchError` lists every missing, unexpected and
        mis-shaped tensor before anything changes. Returns what a ``strict=False`` load skipped.
        A model boosted after :meth:`enable_lora` loads the base model's folder (the adapter is left
        as it is). Collective: every rank calls it."""
        self._arrive("load_pretrained")
        user = self.plugin.unwrap(model.module)
        if lora.is_peft_model(user) and lora.holds_base_names({f"model/{n}" for n in folder_names(folder)}):
            return lora.load_base_pretrained(self.plugin, model.module, folder, strict=strict)
        return load_pretrained(folder, self.plugin, model.module, strict=strict)

    def save_pretrained(
        self, model: BoostedModel, folder: str | os.PathLike, *, config=None, max_shard_size: int | str = "5GB"
    ) -> pathlib.Path:
        """Write the boosted model as a folder that ``transformers``' ``from_pretrained`` loads
        (``model.safetensors``, or shards of at most ``max_shard_size`` plus the index, and
        ``config.json``). ``config``: what to write as ``config.json`` (default: the model's
        ``config`` when it is a ``transformers`` one; none is written otherwise). Tied weights are written
        once, under their first name, as ``transformers`` writes them. The model is gathered
        (rank 0 writes). Collective: every rank calls it."""
        parse_shard_size(max_shard_size)  # bad input raises on every rank, before the gather
        self._arrive("save_pretrained")
        user = self.plugin.unwrap(model.module)
        config = _pretrained_config(user, config)
        full = self.plugin.full_model_state_dict(model.module)
        return self._write_pretrained(full, folder, user, config, max_shard_size)

    def _write_pretrained(self, state: dict, folder, owner: nn.Module, config, max_shard_size) -> pathlib.Path:
        """Rank 0 writes ``state`` as a ``save_pretrained`` folder (tied names of ``owner`` once, its
        generation config when it has one); every rank meets after."""
        if world_rank() == 0:
            save_pretrained(state, folder, max_shard_size=max_shard_size, config=config, tied=aliases(owner))
            generation = getattr(owner, "generation_config", None)
            if generation is not None and hasattr(generation, "save_pretrained"):
                generation.save_pretrained(str(folder))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return pathlib.Path(folder)

    # ---- LoRA adapters (peft; [Note: an adapter folder as a partial checkpoint] in booster/lora.py) ----
    def enable_lora(self, model: nn.Module, lora_config=None) -> nn.Module:
        """Give ``model`` a LoRA adapter before :meth:`boost`: ``peft.get_peft_model(model,
        lora_config)`` (``lora_config`` a ``peft.LoraConfig``), or ``model`` itself when it already is
        a ``peft.PeftModel`` (then ``lora_config`` is None). Build the optimizer over the returned
        model's parameters that require grad (the adapter), then boost as usual.

        Checked here, alike on every rank and before any collective: ``TypeError`` for a config that
        is not a ``peft.LoraConfig``; ``ValueError`` naming the values for ``target_modules`` that
        match no module, a rank ``r`` above ``min(in_features, out_features)`` of a targeted layer,
        and (a given PeftModel) base parameters that still require grad. Needs the ``lora`` extra
        (``pip install 'colossal-stack[lora]'``). Under the hybrid plugin LoRA composes with 1D tensor,
        sequence, pipeline and expert parallelism and dp (``[Note: LoRA under 1D tensor
        parallelism]`` in :mod:`colossalai.booster.hybrid.adapters`); ``NotImplementedError`` for a
        ``tp_mode`` other than 1d."""
        from colossalai.booster.hybrid.adapters import check_lora_layout

        if getattr(self.plugin, "name", None) == "hybrid":
            p = self.plugin
            check_lora_layout(tp_mode=p.tp_mode if p.tp_size > 1 else "1d")
        return lora.enable_lora(model, lora_config)

    def save_lora_as_pretrained(self, model: BoostedModel, folder: str | os.PathLike) -> pathlib.Path:
        """Write the adapter of a boosted :meth:`enable_lora` model as ``PeftModel.save_pretrained``
        does (``adapter_config.json`` and ``adapter_model.safetensors``, PEFT's key names), so that
        ``peft.PeftModel.from_pretrained(base_model, folder)`` loads it. Rank 0 writes; collective:
        every rank calls it."""
        self._arrive("save_lora_as_pretrained")
        user = self.plugin.unwrap(model.module)
        lora.check_peft_model(user)  # a model without an adapter raises on every rank, before the gather
        entries = self.plugin.checkpoint_entries(model.module)
        names = lora.adapter_names(user, entries)
        adapter = lora.gather_entries(self.plugin, model.module, names, entries)  # the adapter only, not the base
        if world_rank() == 0:
            lora.save_adapter(user, adapter, folder)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return pathlib.Path(folder)

    def save_merged_as_pretrained(
        self, model: BoostedModel, folder: str | os.PathLike, *, config=None, max_shard_size: int | str = "5GB"
    ) -> pathlib.Path:
        """Write the base model with the adapter of a boosted :meth:`enable_lora` model merged in,
        as a folder that ``transformers``' ``from_pretrained`` loads into the plain base model (what
        ``peft``'s ``merge_and_unload().save_pretrained(folder)`` writes): the base model's names,
        each adapted weight ``W + scaling * B @ A`` (fp32 arithmetic, stored in ``W``'s dtype), a
        ``modules_to_save`` module's trained copy, ``config.json`` (default: the base model's
        ``config`` when it is a ``transformers`` one; none is written otherwise). The boosted model
        keeps its adapter unmerged. The model is gathered (rank 0 writes). Collective: every rank
        calls it."""
        parse_shard_size(max_shard_size)
        self._arrive("save_merged_as_pretrained")
        user = self.plugin.unwrap(model.module)
        lora.check_peft_model(user)
        base = user.get_base_model()
        config = _pretrained_config(base, config)
        full = self.plugin.full_model_state_dict(model.module)
        merged = lora.merged_state_dict(user, full) if world_rank() == 0 else {}
        return self._write_pretrained(merged, folder, base, config, max_shard_size)

    def load_lora(self, model: BoostedModel, folder: str | os.PathLike, *, strict: bool = True) -> IncompatibleEntries:
        """Load an adapter folder (written by ``peft``'s ``save_pretrained`` or by
        :meth:`save_lora_as_pretrained`) into a boosted :meth:`enable_lora` model, under any plugin
        and world size; the base weights are left as they are (and are not reported missing).

        Strict like :meth:`load_model`, over the adapter's entries only (named as in the file): one
        :class:`~colossalai.checkpoint.CheckpointMismatchError` lists every missing, unexpected and
        mis-shaped one (a different rank ``r``) before anything changes; ``strict=False`` loads the
        ones that match and returns the others as :class:`~colossalai.checkpoint.IncompatibleEntries`
        (mis-shaped ones are always an error). Collective: every rank calls it."""
        self._arrive("load_lora")
        return lora.load_adapter(self.plugin, model.module, folder, strict=strict)
