"""ZeRO 1/2 under expert parallelism: two ``colossal.zero.ZeroOptimizer`` engines behind one
optimizer, the dense parameters sharded over ``dp`` and the experts over ``edp``.

[Note: ZeRO with expert parallelism]
Under ``HybridParallelPlugin(ep_size=E, zero_stage=s)`` the parameters fall into two sets that
reduce over different groups (``[Note: which group reduces which gradient]`` in
``colossal.moe.parallel``): dense ones are replicated on all ``D`` dp ranks (gradient: the mean
over ``dp``), experts are split over ``ep`` and replicated on the ``D / E`` ranks of ``edp``
(gradient: the sum over ``edp`` divided by ``D``). A ZeRO engine reduces and shards over one
group, so :class:`ExpertZeroOptimizer` runs two, each over a view module holding only its own
parameters under their names in the model:

- ``dense``: the non-expert parameters, sharded over ``dp`` (stage 1/2 as asked);
- ``expert``: the expert parameters, sharded over ``edp``. Its engine averages over ``edp``; a
  gradient hook divides each expert gradient by ``E`` as it is produced, so the average over
  ``edp`` of ``g / E`` is ``sum_edp(g) / D``, as required.

The user's optimizer is split into two of the same class and hyperparameters, one per engine, with
the same param groups (a group may be empty in one of them). The user's optimizer keeps its
param groups as the source of the hyperparameters: before every step they are copied into both
(so an LR scheduler built over the user's optimizer keeps working), and a loaded checkpoint writes
them back into it.

Why two engines and not one engine with a process group per param group: ZeRO's flat buckets,
reducer, overflow check, parameter publication and checkpoint gathers each assume one shard
group throughout; threading a group through every one of them would touch all of
``colossal.zero`` for one user (this plugin), while two engines reuse it unchanged. What the
composition must add is exactly what spans both sets, done here:

- **one global norm**: each engine's summed master gradients (divided by its group size) are
  weighted per element by ``c^(-1/p)``, ``c`` the number of ranks of the world holding that
  element after the reduction (dense: ``tp`` replicas of a tp-replicated parameter; experts:
  the ``tp`` ranks, which route the same tokens to the same experts), and summed over the whole
  world, where each dp shard, tp block and ep slice then counts once: the norm of the dense
  model's gradient. Clipping multiplies both engines' master gradients by the same coefficient
  in a step pre-hook of their inner optimizers (after ZeRO's averaging).
- **one overflow decision**: inf/NaN is checked over both engines' gradients and agreed over the
  world before either engine steps; an overflow skips both on every rank.
- **one state**: model and optimizer state are name-keyed over the whole model; the plugin
  then gathers every expert tensor over ``ep`` to its dense shape (``ExpertParallel.to_portable``),
  so a checkpoint loads with any ``ep``, with or without ZeRO, and in any other plugin.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import nn

from colossalai.booster.wrappers import BoostedOptimizer

__all__ = ["ExpertZeroOptimizer", "param_view"]


def param_view(model: nn.Module, keep) -> nn.Module:
    """A module tree holding the parameters of ``model`` for which ``keep(param)`` is true, under
    their names in ``model`` (first name of a tied one); no buffers. What one ZeRO engine wraps."""
    root = nn.Module()
    for name, p in model.named_parameters():
        if not keep(p):
            continue
        *path, attr = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(attr, p)
    return root


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _split_optimizer(optimizer: torch.optim.Optimizer, expert_ids: set[int]):
    """Two optimizers of ``optimizer``'s class and hyperparameters: (dense params, expert params),
    each with the same param groups."""
    if optimizer.state:
        raise ValueError("the optimizer already has state; boost it before its first step")
    parts = []
    for want_expert in (False, True):
        groups = [
            {**_hyper(g), "params": [p for p in g["params"] if (id(p) in expert_ids) == want_expert]}
            for g in optimizer.param_groups
        ]
        try:  # every group carries all its hyperparameters; the constructor's defaults fill nothing
            part = type(optimizer)(groups)
        except TypeError as e:  # a constructor with a required hyperparameter
            try:
                part = type(optimizer)(groups, **optimizer.defaults)
            except TypeError:
                raise TypeError(
                    f"ep_size > 1 with zero_stage needs an optimizer that can be rebuilt from its param "
                    f"groups, as {type(optimizer).__name__}(optimizer.param_groups): {e}"
                ) from e
        part.defaults = dict(optimizer.defaults)
        parts.append(part)
    return parts


class ExpertZeroOptimizer(BoostedOptimizer):
    """The Booster's optimizer for ep x ZeRO 1/2 (``[Note: ZeRO with expert parallelism]``):
    ``step`` steps both engines (or skips both), ``clip_grad_norm`` clips by one global norm,
    ``no_sync`` defers both engines' reductions. Also stands in for the plugin's ZeRO engine:
    ``module``, ``full_model_state_dict``, ``load_full_model_state_dict``, ``named_state_dict``,
    ``load_named_state_dict``.

    ``model``: the (tensor-parallel, expert-split) user module; ``ep``: the plugin's
    :class:`~colossalai.booster.hybrid.ep.ExpertParallel`; ``dp_group``: the dense reduction group;
    ``replicas``: parameter id -> how many tp ranks hold each of its elements (1 without tp);
    ``tp_size``: ranks holding the same experts and tokens (tp peers).
    """

    def __init__(
        self, optimizer, model: nn.Module, ep, stage: int, dp_group, replicas: dict[int, int], tp_size: int = 1
    ) -> None:
        from colossalai.booster.hybrid.zero import zero_engine

        if optimizer is None:
            raise ValueError("HybridParallelPlugin with zero_stage needs an optimizer (boost(model, optimizer, ...))")
        super().__init__(optimizer, scaler=None, params=[])
        self.module, self.ep, self.replicas, self.tp_size = model, ep, replicas, tp_size
        named = dict(model.named_parameters())
        expert_ids = {id(named[n]) for n in ep.dense_shapes}
        # pipeline: other stages' parameters are meta here and belong to no engine
        self.expert_params = [p for p in model.parameters() if id(p) in expert_ids and not p.is_meta]
        dense_opt, expert_opt = _split_optimizer(optimizer, expert_ids)
        ep_size = ep.groups.ep_size
        # the expert engine averages over edp; g / E averaged over edp is sum_edp(g) / D (module note)
        self._hooks = [p.register_hook(lambda g, e=ep_size: g / e) for p in self.expert_params]
        dense_view = param_view(model, lambda p: id(p) not in expert_ids and not p.is_meta)
        expert_view = param_view(model, lambda p: id(p) in expert_ids and not p.is_meta)
        self.dense, self.dense_names = zero_engine(dense_view, dense_opt, stage, dp_group)
        self.expert, self.expert_names = zero_engine(expert_view, expert_opt, stage, ep.groups.edp)
        self.engines = (self.dense, self.expert)
        self._pending: float | None = None  # clip coefficient for the next step
        for engine in self.engines:
            engine.optimizer.register_step_pre_hook(self._clip_before_step)
        self.last_grad_norm: torch.Tensor | None = None

    # ---- the training step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` (fp32 and bf16 only: the hybrid plugin refuses fp16 with ZeRO)."""
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Both engines accumulate locally; the first backward outside reduces everything."""
        with self.dense.no_sync(), self.expert.no_sync():
            yield

    def _summed_grads(self, p: float) -> list[torch.Tensor]:
        """Both engines' master gradients (reduced, averaged) weighted so that, summed over the
        world, every element of the dense model counts once (module note). Waits for the reductions."""
        out = []
        for engine, is_expert in ((self.dense, False), (self.expert, True)):
            engine.grad_norm(p)  # waits for the reductions and fills the masters' summed gradients
            div = engine.world * engine.replicas * engine.scaler.scale
            for flat in engine.flats:
                grad = None if flat.master is None else flat.master.grad
                if grad is None:
                    continue
                weights = torch.full_like(grad, 1.0 / div)
                if p != math.inf:  # a max is not changed by duplicates
                    for s in flat.slices():
                        m = self.tp_size if is_expert else self.replicas.get(id(flat.params[s.index]), 1)
                        if m > 1:
                            weights[s.shard_start : s.shard_start + s.numel] /= m ** (1.0 / p)
                out.append(grad * weights)
        return out

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the dense model's gradient (expert elements counted once per ep slice);
        collective over the world; call between backward and ``step``."""
        from colossal.comm import all_reduce
        from colossal.optim import grad_norm

        p = float(norm_type)
        reduce = functools.partial(all_reduce, tag="hybrid.ep_zero.grad_norm")
        return grad_norm(self._summed_grads(p), p, group=None, all_reduce=reduce)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip both engines' gradients in the next ``step()`` by one global norm; returns that
        norm before clipping, as ``torch.nn.utils.clip_grad_norm_``. Collective."""
        total = self.grad_norm(norm_type)
        self._pending = float(torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
        self.last_grad_norm = total
        return total

    def _clip_before_step(self, optimizer, args, kwargs) -> None:
        if self._pending is None or self._pending == 1.0:
            return
        engine = self.dense if optimizer is self.dense.optimizer else self.expert
        for flat in engine.flats:
            if flat.master is not None and flat.master.grad is not None:
                flat.master.grad.mul_(self._pending)

    def _sync_hyperparameters(self) -> None:
        """The user's param groups (an LR scheduler's target) -> both engines' optimizers."""
        for engine in self.engines:
            for src, dst in zip(self.optim.param_groups, engine.optimizer.param_groups, strict=True):
                dst.update({k: v for k, v in src.items() if k != "params"})

    def step(self, *args, **kwargs) -> None:
        """Step both engines, or skip both on every rank when any gradient is inf/NaN."""
        from colossal.comm import all_reduce
        from colossal.optim import has_inf_or_nan

        try:
            grads = self._summed_grads(2.0)  # waits for every reduction
            reduce = functools.partial(all_reduce, tag="hybrid.ep_zero.overflow")
            found_inf = bool(has_inf_or_nan(grads, None, all_reduce=reduce))
            self.last_step_skipped = found_inf
            if found_inf:
                for engine in self.engines:
                    engine.scaler.update(True)
                    engine.skipped_steps += 1
                    engine.zero_grad()
                return
            self._sync_hyperparameters()
            for engine in self.engines:
                engine.step()
        finally:
            self._pending = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop both engines' accumulated gradients."""
        for engine in self.engines:
            engine.zero_grad(set_to_none)

    def unwrap(self):
        """The two engines ``(dense, expert)``."""
        return self.engines

    # ---- state: name-keyed over the whole model ---------------------------------------------------
    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (experts local to this rank); collective over both groups."""
        values = {}
        for engine in self.engines:
            view = dict(engine.module.named_parameters())
            for n, t in engine.full_model_state_dict().items():
                values[id(view[n])] = t
        own = self.module.state_dict(keep_vars=True).items()
        return {n: values.get(id(t), t.detach()) for n, t in own if not t.is_meta}

    def load_full_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a model state dict (experts local to this rank): parameters into both engines,
        buffers into the model. Collective."""
        own = {n: t for n, t in self.module.state_dict(keep_vars=True).items() if not t.is_meta}
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"state dict mismatch: missing {missing}")
        for engine in self.engines:
            engine.load_full_model_state_dict({n: state[n] for n in engine.module.state_dict()})
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        with torch.no_grad():
            for n, t in own.items():
                if n not in params:
                    t.copy_(state[n])

    def named_state_dict(self) -> dict:
        """``{"state": {name: entry}, "param_groups": [...]}`` over the whole model, param groups
        as the user's optimizer has them (parameter names in its order). Collective."""
        from colossalai.booster.zero_plugin import zero_optimizer_state

        state = {}
        for engine, names in ((self.dense, self.dense_names), (self.expert, self.expert_names)):
            state.update(zero_optimizer_state(engine, names)["state"])
        by_id = {id(p): n for n, p in reversed(list(self.module.named_parameters(remove_duplicate=False)))}
        groups = [
            {**_hyper(g), "params": [by_id[id(p)] for p in g["params"] if not p.is_meta]}
            for g in self.optim.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_named_state_dict(self, sd: dict) -> None:
        """Inverse of :meth:`named_state_dict` (the hyperparameters go to the user's optimizer too)."""
        from colossalai.booster.zero_plugin import load_zero_optimizer

        groups = sd["param_groups"]
        if len(groups) != len(self.optim.param_groups):
            raise ValueError(f"state has {len(groups)} param groups, the optimizer {len(self.optim.param_groups)}")
        for g, sg in zip(self.optim.param_groups, groups, strict=True):
            g.update({k: v for k, v in sg.items() if k != "params"})
        for engine, names in ((self.dense, self.dense_names), (self.expert, self.expert_names)):
            mine = set(names)
            part = {
                "state": {n: v for n, v in sd["state"].items() if n in mine},
                "param_groups": [{**g, "params": [n for n in g["params"] if n in mine]} for g in groups],
            }
            load_zero_optimizer(engine, names, part)

    def state_dict(self) -> dict:
        """:meth:`named_state_dict` (experts local to this rank)."""
        return self.named_state_dict()

    def load_state_dict(self, state: dict) -> None:
        """:meth:`load_named_state_dict`."""
        self.load_named_state_dict(state)
