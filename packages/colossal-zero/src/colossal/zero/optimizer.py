"""The public engine: :class:`ZeroOptimizer` wraps any ``torch.optim.Optimizer`` and a model.

[Note: the optimizer contract]
The user builds their optimizer over ``model.parameters()`` as usual. The wrapper groups the
parameters into flat buffers (stage 1/2: buckets per param group; stage 3: per unit and param
group), keeps one fp32 *master* shard per buffer and re-points the optimizer's ``param_groups``
at those masters (hyperparameters untouched), so any element-wise optimizer steps only this
rank's ``1/N`` of the model. With fp32 working parameters and no offload the master *is* the
shard of the working parameters (no copy), as in the paper's fp32 analogue.

[Note: parameters without a gradient]
``torch.optim`` skips a parameter whose ``.grad`` is None: no weight decay, no momentum, no step
count. A flat master shard cannot skip part of itself, so each step first agrees, over the shard
(and replicate) group, which parameters got a gradient on *any* rank since the last ``zero_grad``
(one all-reduce of a byte per trainable parameter; under data parallelism, as with DDP, a gradient
from one rank is the gradient of every rank). The usual step (every parameter has one) steps the
flat masters. The first step that has a parameter without one switches the engine, for good, to
per-parameter views of the masters (:class:`~colossal.zero._layerwise.ParamShardViews`, as the
layer-wise optimizers use; the flat states are split into them): those parameters' views get no
gradient, so they and their states (including their own ``step``) stay as they were, exactly as
with ``torch.optim``. The decision is the same on every rank, so LAMB/LARS norm vectors still line
up (every rank leaves out the same parameters).

[Note: frozen parameters]
A parameter with ``requires_grad=False`` (a frozen base under LoRA) never gets a gradient, even
when the optimizer lists it (``AdamW(model.parameters())``, as PEFT users write it), so it gets no
fp32 master and no optimizer state: stages 1/2 leave it out of the buckets (it stays whole on every
rank, as under DDP, and is not all-gathered after each step); stage 3 shards it in its unit's flat
without a master (gathered for compute, freed after, like a parameter outside the optimizer). The
optimizer's state dict still lists it in its group, with no state, as ``torch.optim`` does.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from colossal.comm import all_reduce, broadcast, group_ranks, register_observer
from colossal.optim import (
    ConstantLossScaler,
    DynamicLossScaler,
    OptimizerWrapper,
    clip_grad_norm_,
    grad_norm,
    has_inf_or_nan,
)
from colossal.zero import _events, checkpoint
from colossal.zero._flat_param import FlatParam
from colossal.zero._layerwise import ParamShardViews, is_layerwise
from colossal.zero._reducer import GradReducer
from colossal.zero._validate import validate
from colossal.zero.config import ZeroConfig
from colossal.zero.module_state import install_module_state_hooks
from colossal.zero.offload import master_grad, place_master
from colossal.zero.stage3 import Stage3Engine, Unit, assign_params, find_units
from colossal.zero.stage12 import build_buckets, gather_updated_params, start_gather_updated_params

__all__ = ["ZeroOptimizer"]


def _duplicate_group(group):
    """A second process group over the same ranks, so gradient reduce-scatters and parameter
    all-gathers never share one ordered queue (they overlap, and their orders are independent).
    Every rank of the world must call this together (as with every ``new_group``)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, group_ranks(group))
    mine = None
    for ranks in sorted(set(map(tuple, everyone))):
        new = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            mine = new
    return mine


class ZeroOptimizer(OptimizerWrapper):
    """ZeRO stage 1/2/3 around ``optimizer`` for ``model`` over a data-parallel group.

    ``ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2)``; keyword arguments
    are :class:`~colossal.zero.ZeroConfig` fields (or pass ``config=``). Stage 3 shards ``model``
    in place (hooks gather each unit's parameters when needed). Loop: ``zero.backward(loss)``
    (or ``loss.backward()`` when not using fp16), ``zero.step()``, ``zero.zero_grad()``.

    A ``torch.optim.Optimizer`` (``[Note: wrappers are optimizers]`` in ``colossal.optim.wrapper``):
    torch's LR schedulers and step hooks work on it directly; ``param_groups`` are the wrapped
    optimizer's (their ``params`` are the fp32 master shards), ``state_dict()`` the full state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *, config: ZeroConfig | None = None, **kw):
        if config is not None and kw:
            raise TypeError(f"give either config= or keyword fields, not both (got {sorted(kw)})")
        self.config = cfg = config if config is not None else ZeroConfig(**kw)
        self.device = validate(optimizer, model, cfg)
        self._wrap(optimizer)
        self.optimizer, self.module = optimizer, model
        self.world, self.replicas = cfg.world()
        self.rank = dist.get_rank(cfg.group)
        self._orig_groups = [list(g["params"]) for g in optimizer.param_groups]
        self._names = {p: n for n, p in model.named_parameters()}
        self._reduce_group = _duplicate_group(cfg.group)
        self.flats, self.units = self._build_flats()
        trained = [f for f in self.flats if f.group_index is not None]
        n_host = round(cfg.offload_fraction * len(trained))  # the last ones, as Gemini's static policy
        self._offloaded = {id(f) for f in trained[len(trained) - n_host :]}
        for flat in self.flats:
            self._materialize(flat)
        # LAMB/LARS get per-parameter views of the masters ([Note: layer-wise optimizers]).
        self._views = ParamShardViews(optimizer, self.flats, cfg.group) if is_layerwise(optimizer) else None
        for gi, group in enumerate(optimizer.param_groups):
            if self._views is not None:
                group["params"] = self._views.group_params(gi)
            else:
                group["params"] = [f.master for f in self.flats if f.group_index == gi]
        self.reducer = GradReducer(self._reduce_order(), self._reduce_group, cfg.replicate_group, cfg.stage == 1,
                                   cfg.max_inflight)  # fmt: skip
        self.engine = Stage3Engine(self.units, cfg.group, cfg.prefetch, cfg.reshard_root) if cfg.stage == 3 else None
        if self.engine is not None:
            self.engine.reducer = self.reducer
            self.reducer.on_complete = self.engine.on_flat_complete
            self.reducer.on_backward_end = self.engine.on_backward_end
        self._pending_gathers: dict[int, object] = {}  # id(bucket) -> all-gather handle (overlap_param_gather)
        if cfg.overlap_param_gather:
            self._install_gather_waits()
        self.scaler = self._make_scaler()
        self.skipped_steps = 0
        """Steps skipped because a gradient was inf/NaN on some rank."""
        self.last_grad_norm: torch.Tensor | None = None
        """Global gradient norm of the last step (when ``max_grad_norm`` is set)."""
        self.last_step_comm: dict[str, int] = {}
        """Message bytes per collective (nccl-tests convention) issued by this engine in the last step."""
        self._comm_now: dict[str, int] = defaultdict(int)
        self._observer = register_observer(_CommTap(self))
        weakref.finalize(self, self._observer.remove)
        model._colossal_zero = weakref.ref(self)
        install_module_state_hooks(self)  # model.state_dict() / load_state_dict() speak for the shards

    # -- construction ---------------------------------------------------------------------------
    def _build_flats(self) -> tuple[list[FlatParam], list[Unit]]:
        cfg = self.config
        if cfg.stage != 3:
            return build_buckets(self.optimizer, self._names, cfg.bucket_numel, self.world, self.rank), []
        group_of = {p: gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        modules = find_units(self.module, cfg.wrap_policy)
        units = []
        for ui, (mod, params) in enumerate(zip(modules, assign_params(self.module, modules), strict=True)):
            by_group: dict[int | None, list[nn.Parameter]] = {}
            for p in params:  # a frozen parameter is sharded without a master ([Note: frozen parameters])
                by_group.setdefault(group_of.get(p) if p.requires_grad else None, []).append(p)
            flats = [
                FlatParam(ps, [self._names[p] for p in ps], gi, self.world, self.rank) for gi, ps in by_group.items()
            ]
            units.append(Unit(mod, flats, is_root=ui == 0))
        return [f for u in units for f in u.flats], units

    def _reduce_order(self) -> list[FlatParam]:
        """Stage 3: units in reverse registration order (the usual backward order)."""
        return self.flats if not self.units else [f for u in reversed(self.units) for f in u.flats]

    def _materialize(self, flat: FlatParam) -> None:
        cfg = self.config
        full32 = flat.flatten(torch.float32, self.device)  # (padded_numel,)
        if cfg.sync_module_states:
            broadcast(full32, 0, cfg.group, tag="zero.sync_module_states")
            if cfg.replicate_group is not None:
                broadcast(full32, 0, cfg.replicate_group, tag="zero.sync_module_states")
        full = full32 if cfg.param_dtype == torch.float32 else full32.to(cfg.param_dtype)
        flat.init_full(full)
        own = flat.local(full)
        if cfg.stage == 3:
            flat.shard = own.clone()  # (shard_numel,) the persistent local shard
            own = flat.shard
        if flat.group_index is not None:
            place_master(flat, own, flat.local(full32), id(flat) in self._offloaded)
        if cfg.stage == 3:
            flat.to_sharded()  # frees full (and full32 when it is the same tensor)

    def _make_scaler(self):
        cfg = self.config
        if cfg.param_dtype != torch.float16:
            return ConstantLossScaler()
        return DynamicLossScaler(
            initial_scale=cfg.initial_scale, growth_interval=cfg.growth_interval, hysteresis=cfg.hysteresis
        )

    # -- the training loop ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scale (fp16)."""
        self.scaler.scale_loss(loss).backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communication; the first
        backward outside reduces everything accumulated (gradient accumulation)."""
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = True

    def step(self, closure=None) -> bool:
        """Unscale, check for inf/NaN (agreed by all ranks), clip, step the shards, publish the
        updated parameters. Returns False when the step was skipped."""
        if closure is not None:
            raise NotImplementedError("ZeroOptimizer.step supports closure=None only")
        with torch.profiler.record_function("colossal.zero::step"):
            self.wait_params()  # buckets no forward used since the last step
            self.reducer.wait_all()
            grads = self._master_grads()
            if has_inf_or_nan(grads, self.config.group, all_reduce=functools.partial(all_reduce, tag="zero.overflow")):
                self.scaler.update(True)
                self.skipped_steps += 1
                self._finish_step()
                return False
            for g in grads:
                g.mul_(1.0 / (self.world * self.replicas))  # gradients were summed over ranks
            self.scaler.unscale_(grads)
            without = self._params_without_grad()
            if self.config.max_grad_norm is not None:
                self.last_grad_norm = clip_grad_norm_(
                    grads,
                    self.config.max_grad_norm,
                    group=self.config.group,
                    all_reduce=functools.partial(all_reduce, tag="zero.grad_norm"),
                )
            self._optimizer_step(without)
            self.scaler.update(False)
            self._publish_params()
            self._finish_step()
            return True

    def _params_without_grad(self) -> dict[int, set[int]]:
        """``id(flat) -> indices`` of trainable parameters no rank gave a gradient since the last
        ``zero_grad`` (see ``[Note: parameters without a gradient]``); collective when distributed."""
        flats = self.reducer.flats
        got = [i in f.got_grad for f in flats for i in f.trainable]
        if self.world * self.replicas > 1:
            flags = torch.tensor(got, dtype=torch.uint8, device=self.device)
            all_reduce(flags, "max", self.config.group, tag="zero.grad_presence")
            if self.config.replicate_group is not None:
                all_reduce(flags, "max", self.config.replicate_group, tag="zero.grad_presence")
            got = flags.bool().tolist()
        out: dict[int, set[int]] = {}
        it = iter(got)
        for f in flats:
            got_f = {i: next(it) for i in f.trainable}  # frozen parameters handed to the optimizer never have one
            missing = {i for i in range(len(f.params)) if not got_f.get(i, False)}
            if missing:
                out[id(f)] = missing
        return out

    def _use_param_views(self) -> None:
        """Switch an element-wise optimizer from flat masters to per-parameter views, keeping its state."""
        states = {id(f): self.optimizer.state.pop(f.master, {}) for f in self.flats if f.master is not None}
        self._views = ParamShardViews(self.optimizer, self.flats, self.config.group, layerwise=False)
        for gi, group in enumerate(self.optimizer.param_groups):
            group["params"] = self._views.group_params(gi)
        for f in self._views.flats:
            if states[id(f)]:
                self._views.set_flat_state(f, states[id(f)])

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of the gradients the next ``step()`` applies (averaged over ranks, unscaled),
        over every rank's shards: what ``torch.nn.utils.clip_grad_norm_`` returns. Collective; call
        between backward and ``step()``."""
        self.wait_params()
        self.reducer.wait_all()
        grads = self._master_grads()
        total = grad_norm(
            grads, norm_type, group=self.config.group, all_reduce=functools.partial(all_reduce, tag="zero.grad_norm")
        )
        return total / (self.world * self.replicas * self.scaler.scale)

    def _optimizer_step(self, without: dict[int, set[int]] | None = None) -> None:
        if self._views is None and without:
            self._use_param_views()
        if self._views is None:
            self.optimizer.step()
            return
        self._views.attach_grads(without)
        try:
            self.optimizer.step()
        finally:
            self._views.detach_grads()

    def _flat_state(self, flat: FlatParam) -> dict:
        """The optimizer state of ``flat``'s master shard (element-wise layout, as checkpoints hold it)."""
        if self._views is not None:
            return self._views.flat_state(flat)
        return self.optimizer.state.get(flat.master, {})

    def _param_states(self, flat: FlatParam) -> list[dict | None]:
        """Per parameter of ``flat``: its scalar states (a dict, maybe empty) when it has optimizer
        state, ``None`` when it has none (it never had a gradient: [Note: parameters without a
        gradient]). The same on every rank: each holds a view of every parameter, empty or not."""
        if self._views is not None:
            return self._views.param_states(flat)
        state = self._flat_state(flat)
        shared = {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() >= 1)}
        return [shared if state else None] * len(flat.params)

    def _set_param_states(self, flat: FlatParam, state: dict, scalars: list[dict | None]) -> None:
        """Load ``flat``'s element-wise ``state`` (``(shard_numel,)`` tensors) and each parameter's
        scalars, ``None`` for a parameter left without state. Element-wise rules share the flat
        state unless parameters differ (one without state, or one that skipped a step), which
        switches to per-parameter views ([Note: parameters without a gradient])."""
        have = [sc for sc in scalars if sc is not None]
        mixed = len(have) not in (0, len(scalars)) or any(_scalars_differ(have[0], sc) for sc in have[1:])
        if self._views is None and mixed:
            self._use_param_views()
        if self._views is not None:
            self._views.set_flat_state(flat, state, scalars)
        elif have:
            self.optimizer.state[flat.master] = {**state, **have[0]}
        else:
            self.optimizer.state.pop(flat.master, None)

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 ``.grad`` of every master: the reduced shard sums (moved to the CPU when offloading)."""
        return [master_grad(f, self.reducer.sharded_grad(f), i) for i, f in enumerate(self.reducer.flats)]

    def _install_gather_waits(self) -> None:
        """Forward pre-hooks that wait for the pending gathers of the buckets a module's own
        parameters live in (``overlap_param_gather``)."""
        bucket_of = {id(p): id(flat) for flat in self.flats for p in flat.params}
        for module in self.module.modules():
            ids = tuple(dict.fromkeys(bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of))
            if ids:
                module.register_forward_pre_hook(lambda mod, args, ids=ids: self._wait_gathers(ids))

    def _wait_gathers(self, ids) -> None:
        for i in ids:
            handle = self._pending_gathers.pop(i, None)
            if handle is not None:
                handle.wait()

    def wait_params(self) -> None:
        """Finish every parameter all-gather still in flight (``overlap_param_gather``): call it
        before reading parameters outside a forward. A no-op otherwise."""
        self._wait_gathers(list(self._pending_gathers))

    def _publish_params(self) -> None:
        masters = [f for f in self.flats if f.master is not None]
        if self.config.stage != 3:
            self.wait_params()
            if self.config.overlap_param_gather:
                started = start_gather_updated_params(masters, self.config.group)
                self._pending_gathers = {id(flat): handle for flat, handle in started}
            else:
                gather_updated_params(masters, self.config.group)
            return
        for flat in masters:
            if not flat.master_aliased:
                flat.shard.copy_(flat.master)

    def _finish_step(self) -> None:
        if _events.has_observers():  # sampled before the gradients are dropped
            now, tiers = time.perf_counter(), self.memory_by_tier()
            for tier, nbytes in tiers.items():
                _events.emit(_events.MemorySample(time=now, tier=tier, model_bytes=nbytes, label="zero.step"))
        self.zero_grad()
        self.last_step_comm, self._comm_now = dict(self._comm_now), defaultdict(int)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients (the sharded ones and any left on parameters)."""
        self.reducer.zero_grad()  # stage 1 keeps its views (zeroed); stages 2/3 drop them
        managed = {id(f) for f in self.reducer.flats}
        for flat in self.flats:
            if flat.master is not None:
                flat.master.grad = None
            if id(flat) not in managed:
                for p in flat.params:
                    p.grad = None

    # -- observability --------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now: ``params`` (working), ``grads``, ``optimizer_states``
        (fp32 masters not aliased to the parameters + every optimizer state tensor), ``total``.
        Stage 2/3 gradient shards exist from backward until ``zero_grad`` (read it after backward
        to see the step's full model states)."""
        return {k: sum(v.values()) for k, v in self._memory().items()} | {"total": sum(self.memory_by_tier().values())}

    def memory_by_tier(self) -> dict[str, int]:
        """Model-state bytes per memory tier (``"cuda"``/``"cpu"``)."""
        out: dict[str, int] = defaultdict(int)
        for per_tier in self._memory().values():
            for tier, n in per_tier.items():
                out[tier] += n
        return dict(out)

    def _memory(self) -> dict[str, dict[str, int]]:
        out = {"params": defaultdict(int), "grads": defaultdict(int), "optimizer_states": defaultdict(int)}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is not None:  # storage bytes: a freed stage-3 buffer holds none
                nbytes = min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                out[kind]["cuda" if t.device.type == "cuda" else "cpu"] += nbytes

        for flat in self.flats:
            add("params", flat.full)
            add("params", flat.shard)
            add("grads", flat.full_grad)
            add("grads", flat.shard_grad)
            if flat.master is not None and not flat.master_aliased:
                add("optimizer_states", flat.master)
            if flat.master is None:
                continue
            if self._views is not None:
                states = self._views.state_tensors(flat)
            else:
                states = [v for v in self.optimizer.state.get(flat.master, {}).values() if torch.is_tensor(v)]
            for v in states:
                add("optimizer_states", v)
        return {k: dict(v) for k, v in out.items()}

    # -- state ----------------------------------------------------------------------------------
    # [Note: state is collective] Every method below that gathers or saves (full_model_state_dict,
    # state_dict, save_sharded) or loads (load_*) runs collectives over the engine's group: call it
    # on every rank, never under ``if rank == 0:``; a call on some ranks only raises a CheckpointError
    # naming the missing ranks after ``checkpoint_timeout`` seconds (the arrival check of colossal.comm).
    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (fp32 master values), loadable by the plain model.
        Collective (an all-gather per buffer): call on every rank; each gets the full dict."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        return checkpoint.full_model_state_dict(self)

    def state_dict(self) -> dict:
        """The optimizer state in plain ``torch.optim`` form (full tensors, indices over the
        original ``model.parameters()`` groups) plus ``"loss_scaler"``. Collective (an all-gather
        per state tensor): call on every rank, not only on the one that writes the file."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        return checkpoint.full_optimizer_state_dict(self)

    def load_full_model_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a plain (unsharded) model state dict into the shards, working parameters and
        buffers, strict like ``torch.nn.Module.load_state_dict`` (returns its ``_IncompatibleKeys``).
        Every rank calls it with the full dict (stages 1/2 re-gather the parameters: collective)."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        return checkpoint.load_full_model_state_dict(self, state_dict, strict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a plain optimizer state dict (as :meth:`state_dict` or ``torch.optim`` writes it);
        every rank calls it with the full dict (no communication; each keeps its own slices)."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        checkpoint.load_full_optimizer_state_dict(self, state_dict)

    def save_sharded(self, path: str) -> None:
        """Save model + optimizer shards with ``torch.distributed.checkpoint`` (any world size
        loads). Collective: every rank calls it with the same ``path``."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        checkpoint.save_sharded(self, path)

    def load_sharded(self, path: str, *, strict: bool = True):
        """Load a checkpoint written by :meth:`save_sharded` on any number of ranks. Collective.
        Strict (one ``CheckpointMismatchError`` listing every missing, unexpected and mis-shaped
        entry before anything changes); ``strict=False`` returns what it skipped
        (:func:`colossal.zero.load_sharded`)."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        return checkpoint.load_sharded(self, path, strict=strict)

    def sharded_state_dict(self, *, include_optimizer: bool = True) -> dict[str, torch.Tensor]:
        """This rank's pieces of the flat-slice checkpoint format (``model/<name>@<start>``,
        ``optim/<name>/<key>@<start>``, scalars and 0-dim tensors under their plain keys; [Note:
        the sharded layout] in :mod:`colossal.zero.checkpoint`): views of its own slices, nothing
        gathered. Writing them (``dcp.save``) is collective: every rank does."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        return checkpoint.sharded_state_dict(self, include_optimizer=include_optimizer)

    def sharded_entries(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (logical shape, dtype name)`` of every model entry :meth:`sharded_state_dict`
        writes, the same on every rank (for strict loading); no communication."""
        return checkpoint.sharded_entries(self)

    def load_sharded_state_dict(
        self, metadata, load, *, include_optimizer: bool = True, skip: set[str] = frozenset()
    ) -> None:
        """Load a flat-slice checkpoint written on any world size, reading only the pieces that
        overlap this rank's slices: ``metadata`` is its DCP ``state_dict_metadata``, ``load(tensors)``
        fills a dict of tensors in place (e.g. ``dcp.load``); collective, once per rank. ``skip``:
        names the checkpoint lacks that stay as they are (a non-strict load)."""
        self.wait_params()  # a pending parameter gather reads and writes these buffers
        checkpoint.load_sharded_state_dict(self, metadata, load, include_optimizer=include_optimizer, skip=skip)


def _scalars_differ(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return bool(a) and bool(b)  # a parameter with no state yet (held elsewhere) says nothing
    return any(float(a[k]) != float(b[k]) for k in a if isinstance(a[k], (int, float, torch.Tensor)))


class _CommTap:
    """Comm observer adding this engine's collectives (tag ``zero.*``) to the current step."""

    def __init__(self, zero: ZeroOptimizer):
        self._zero = weakref.ref(zero)

    def __call__(self, event) -> None:
        zero = self._zero()
        if zero is not None and event.tag.startswith("zero."):
            zero._comm_now[event.op] += event.nbytes
