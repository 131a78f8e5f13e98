"""Expert parallelism for the Booster: shard every MoE layer's experts over an ``ep`` group,
reduce expert gradients over their own group, and keep checkpoints in dense form.

[Note: expert parallelism in the hybrid plugin]
``HybridParallelPlugin(ep_size=E)`` composes this module with DDP or ZeRO 1/2, 1D tensor
parallelism and pipeline parallelism:

1. Groups: the plugin's ``dp`` group (``D`` ranks) is split into ``edp x ep`` with ``ep`` inner:
   each run of ``E`` consecutive dp ranks shares out the experts (the ``ep`` group), the ranks
   ``E`` apart hold the same experts (the ``edp`` group, ``D / E`` ranks); dense parameters still
   reduce over all of ``dp`` (``colossal.moe.expert_groups`` on the dp group). Checked before any
   group is made (:func:`check_ep`): ``E`` divides ``D``, the model has expert layers
   (:func:`expert_layers`: ``colossal.moe.MoE``, or a Hugging Face Mixtral's sparse-MoE blocks,
   which its policy replaces by :class:`~colossalai.policies.hf_moe.MixtralExpertParallelBlock`),
   each layer's expert count is divisible by ``E``.
2. ``configure``: after tensor-parallel conversion (1D only: the MoE layers are not converted, so
   every tp rank of a dp rank holds the same experts and routes the same tokens; 2D/2.5D/3D tp
   raise ``ValueError`` in the plugin's constructor; sp: ``[Note: expert x sequence
   parallelism]``) and before the pipeline cuts the model (so its stages capture the local
   experts) and before DDP or ZeRO,
   :func:`apply_expert_parallel` swaps each ``MoE`` for its local slice in place, then the
   optimizer is rebound by name.
3. DDP ignores the expert parameters (under the wrapped module's names), so it averages dense
   gradients only; :class:`ExpertParallelOptimizer` calls :meth:`ExpertParallel.reduce_expert_gradients`
   once per step, before clipping and ``step``, and clips by the norm of the dense model (the
   non-expert gradients counted over tp as without ep, expert gradients summed over ``ep``).
   Gradient accumulation under ``no_sync`` keeps working: the expert reduction waits for ``step``.
   Under pipeline parallelism the pipeline step averages the dense gradients over ``dp`` and
   :class:`ExpertPipelineOptimizer` reduces the experts and clips over the whole world.
4. State: the plugin's ``_to_portable`` / ``_to_local`` route expert names through
   :meth:`ExpertParallel.to_portable` / :meth:`ExpertParallel.to_local` (before the tensor-parallel
   routing), so model and optimizer checkpoints hold every expert under its dense name and load
   with any ``ep`` or in any other plugin.
5. ZeRO 1/2: two engines, dense states over ``dp`` and expert states over ``edp``
   (``[Note: ZeRO with expert parallelism]`` in :mod:`colossalai.booster.hybrid.ep_zero`).
6. The Booster adds ``model.aux_loss()`` to the criterion's loss (``Booster(moe_aux_loss=True)``,
   the default), whichever plugin runs; under pipeline parallelism per stage
   (``[Note: MoE auxiliary losses]`` in :mod:`colossalai.booster.booster`).

[Note: expert x sequence parallelism]
With ``sp_size > 1`` the plugin's data-parallel group is ``dp x sp`` (sp ranks hold different
tokens of the same rows), and the experts are split over it as over plain dp: ``ep`` consecutive
ranks of ``dp x sp`` share out the experts, ``edp`` is the rest. A Hugging Face Mixtral block is
per token and dropless (every assignment runs), so routing a sequence's ``T/sp`` chunks on
different ranks computes exactly what one forward of the whole rows does; every gradient entering
the sequence-parallel model is scaled by ``sp`` (``[Note: sequence-parallel gradients]``), experts'
included, so summing expert gradients over ``edp`` and dividing by ``|dp x sp|`` gives the mean
over ``dp`` of the full gradients, as for the dense ones. Not so for ``colossal.moe.MoE`` (capacity
and load-balancing loss per rank, i.e. per ``T/sp`` chunk) nor for a Mixtral trained with its
router aux loss (``output_router_logits=True``: a product of means over every token of the
forward): both raise before any collective (:func:`check_ep`, the Mixtral policy's ``check``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel as DDP

from colossal.comm import all_gather, all_reduce
from colossal.moe import ExpertGroups, MoE, expert_groups
from colossalai.booster.hybrid.pp import PipelineOptimizer
from colossalai.booster.hybrid.shards import TensorParallelOptimizer, multiplicity

__all__ = [
    "ExpertLayer",
    "ExpertParallel",
    "ExpertParallelOptimizer",
    "ExpertPipelineOptimizer",
    "apply_expert_parallel",
    "check_ep",
    "expert_free_replicas",
    "expert_layers",
]


@dataclasses.dataclass(slots=True)
class ExpertParallel:
    """What :func:`apply_expert_parallel` did: the groups and the experts' dense shapes."""

    groups: ExpertGroups
    """``ep`` (experts split), ``edp`` (same experts), ``dp`` (dense gradients)."""
    dense_shapes: dict[str, torch.Size]
    """Expert parameter name -> its full shape over all experts (dim 0 = experts)."""
    _mesh: object = None  # the ep group as a 1-D DeviceMesh (row templates), built on first use

    @property
    def expert_param_names(self) -> list[str]:
        """Names of the parameters split over ``ep`` (DDP must ignore them)."""
        return list(self.dense_shapes)

    def expert_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """``model``'s expert parameters (under pipeline parallelism other stages' are meta)."""
        params = dict(model.named_parameters())
        return [params[n] for n in self.dense_shapes]

    def reduce_expert_gradients(self, model: nn.Module) -> None:
        """Expert gradients summed over ``edp`` and divided by the dp size (the mean-loss
        gradient; see ``[Note: which group reduces which gradient]`` in ``colossal.moe.parallel``)."""
        params = dict(model.named_parameters())
        grads = [params[n].grad for n in self.dense_shapes if params[n].grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dist.get_world_size(self.groups.edp) > 1:
            all_reduce(flat, group=self.groups.edp, tag="hybrid_ep.expert_grad")
        flat.div_(self.groups.dp_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def to_portable(self, name: str, local: torch.Tensor, rows: bool = False) -> torch.Tensor:
        """The full tensor of expert parameter ``name`` (gathered over ``ep``); others as they are.
        ``rows``: instead, a ``DTensor`` ``Shard(0)`` over the ep group holding this rank's rows
        (no communication; a template from which a checkpoint reader reads only this rank's experts)."""
        if name not in self.dense_shapes or self.groups.ep_size == 1:
            return local
        if rows:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Shard

            if self._mesh is None:
                self._mesh = DeviceMesh.from_group(self.groups.ep, local.device.type)
            return DTensor.from_local(local.contiguous(), self._mesh, [Shard(0)], run_check=False)
        return all_gather(local.contiguous(), group=self.groups.ep, tag="hybrid_ep.state")

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full tensor of ``name`` (others as they are), or the local rows
        of a ``to_portable(..., rows=True)`` template."""
        if name not in self.dense_shapes:
            return full
        if hasattr(full, "to_local") and hasattr(full, "placements"):  # a DTensor row template
            return full.to_local()
        if tuple(full.shape) != tuple(self.dense_shapes[name]):
            raise ValueError(f"{name}: expected shape {tuple(self.dense_shapes[name])}, got {tuple(full.shape)}")
        per = full.shape[0] // self.groups.ep_size
        r = dist.get_rank(self.groups.ep)
        return full[r * per : (r + 1) * per]

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every expert tensor gathered to its dense shape."""
        return {n: self.to_portable(n, t.detach()) for n, t in model.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Strictly load a dense state dict (any ``ep`` saved it): this rank keeps its experts."""
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        local = {n: self.to_local(n, t) for n, t in state.items()}
        bad = [f"{n}: {tuple(local[n].shape)} != {tuple(t.shape)}" for n, t in own.items() if local[n].shape != t.shape]
        if bad:
            raise ValueError(f"state dict shape mismatch: {bad}")
        for n, t in own.items():
            t.copy_(local[n])


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertLayer:
    """One layer expert parallelism can split: a ``colossal.moe.MoE``, or a Hugging Face sparse-MoE
    block its family's policy splits (Mixtral, :mod:`colossalai.policies.hf_moe`). Its expert
    parameters are those of its ``experts`` child, stacked along dim 0 (one row per expert)."""

    module: nn.Module
    """The layer holding every expert."""
    num_experts: int
    """Experts over all ranks."""
    ep_size: int
    """Ranks it is already split over (1: not split)."""
    split: Callable[[ProcessGroup], nn.Module]
    """``split(ep_group)``: a new layer holding only this rank's experts."""


def expert_layers(model: nn.Module) -> dict[str, ExpertLayer]:
    """Name -> :class:`ExpertLayer` of every layer of ``model`` that ``ep_size`` splits. Local."""
    from colossalai.policies import hf_policy

    layers = {
        n: ExpertLayer(module=m, num_experts=m.config.num_experts, ep_size=m.ep_size, split=partial(MoE.from_dense, m))
        for n, m in model.named_modules()
        if isinstance(m, MoE)
    }
    policy = hf_policy(model)
    if policy is not None:
        for n, m in policy.expert_blocks(model).items():
            num, ep = m.experts.num_experts, getattr(m, "ep_size", 1)
            layers[n] = ExpertLayer(module=m, num_experts=num, ep_size=ep, split=partial(policy.split_experts, m))
    return layers


def check_ep(model: nn.Module, ep_size: int, dp_size: int, sp_size: int = 1) -> dict[str, ExpertLayer]:
    """The model's expert layers (:func:`expert_layers`), once ``ep_size`` is checked against them
    and against the data-parallel size (``dp x sp`` ranks with sequence parallelism, ``[Note: expert x
    sequence parallelism]``); raises ``ValueError`` naming the bad values. Local: no collective."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or dp_size % ep_size:
        raise ValueError(f"ep_size={ep_size!r} must be a positive int dividing the data-parallel size {dp_size}")
    layers = expert_layers(model)
    if not layers:
        raise ValueError(
            f"ep_size={ep_size}: the model has no colossal.moe.MoE layer (nor Hugging Face Mixtral sparse-MoE "
            f"block) to split over experts"
        )
    capped = sorted(n for n, m in layers.items() if isinstance(m.module, MoE))
    if sp_size > 1 and capped:
        raise ValueError(
            f"ep_size={ep_size} with sp_size={sp_size}: {capped} are colossal.moe.MoE layers, whose expert "
            f"capacity and aux loss are per rank; under sequence parallelism each rank would route, cap and "
            f"balance only its T/{sp_size} tokens of every sequence, which no dense forward does (unsupported "
            f"combination; expert x sequence parallelism is for Hugging Face Mixtral's dropless blocks)"
        )
    for n, m in layers.items():
        if m.ep_size != 1:
            raise ValueError(f"{n} is already split over ep={m.ep_size}; build the model with all experts")
        if m.num_experts % ep_size:
            raise ValueError(f"{n}: num_experts={m.num_experts} is not divisible by ep_size={ep_size}")
    return layers


def apply_expert_parallel(
    model: nn.Module, ep_size: int, dp_group: ProcessGroup | None = None, ddp_root: nn.Module | None = None
) -> ExpertParallel:
    """Split every expert layer of ``model`` (:func:`expert_layers`) over ``ep_size`` ranks, in place.

    Each layer must hold all its experts (a ``MoE`` built with no ``ep_group``); rank ``r`` of its ep
    group keeps experts ``r * E/ep .. (r+1) * E/ep - 1`` (:meth:`MoE.from_dense`, or the Hugging Face
    policy's ``split_experts``). Validates every layer and the sizes before creating any group,
    identically on every rank (:func:`check_ep`). Marks the expert parameters for DDP to ignore,
    under their names in ``ddp_root`` (the module DDP will wrap, which contains ``model``; default
    ``model`` itself). Call on every rank of the world (group creation is collective), each with
    its own ``dp_group`` (default: the world).
    """
    layers = check_ep(model, ep_size, dist.get_world_size(dp_group))
    groups = expert_groups(ep_size, dp_group)
    shapes = {f"{n}.experts.{p}": t.shape for n, m in layers.items() for p, t in m.module.experts.named_parameters()}
    for n, m in layers.items():
        _replace(model, n, m.split(groups.ep))
    ep = ExpertParallel(groups=groups, dense_shapes=shapes)
    root = model if ddp_root is None else ddp_root
    experts = {id(p) for p in ep.expert_parameters(model)}
    DDP._set_params_and_buffers_to_ignore_for_model(root, [n for n, p in root.named_parameters() if id(p) in experts])
    return ep


class ExpertParallelOptimizer(TensorParallelOptimizer):
    """The hybrid plugin's optimizer under expert parallelism: expert gradients are reduced over
    ``edp`` once per step (before clipping and ``step``). Clipping uses the norm of the dense
    model: the non-expert gradients as the tensor-parallel optimizer counts them (``replicas``,
    over ``group``, the tp group) combined with the expert gradients summed over ``ep`` (experts
    are replicated on the tp ranks, split over ep). fp16's overflow check spans every rank."""

    def __init__(self, optimizer, model: nn.Module, ep: ExpertParallel, replicas, group, group_size: int, scaler=None):
        experts = {id(p) for p in ep.expert_parameters(model)}
        super().__init__(optimizer, [(p, m) for p, m in replicas if id(p) not in experts], group, group_size, scaler)
        self.experts = [p for p in model.parameters() if id(p) in experts]
        self.ep, self.model, self._reduced = ep, model, False

    def _reduce_experts(self) -> None:
        if not self._reduced:
            self.ep.reduce_expert_gradients(self.model)
            self._reduced = True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Reduce the expert gradients, then clip every gradient by the norm of the dense model's."""
        import math

        from colossal.optim import grad_norm

        self._reduce_experts()
        self._unscale()
        p = float(norm_type)
        sharded, replicated = self._split(p)
        dense = grad_norm(sharded, p, group=self.tp_group, replicated=replicated)
        expert = grad_norm([e.grad for e in self.experts if e.grad is not None], p, group=self.ep.groups.ep)
        expert = expert.to(dense.device)
        total = torch.maximum(dense, expert) if p == math.inf else (dense**p + expert**p) ** (1.0 / p)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param in [q for q, _ in self.replicas] + self.experts:
            if param.grad is not None:
                param.grad.mul_(coef.to(param.grad.device))
        return total

    def step(self, *args, **kwargs) -> None:
        """Reduce the expert gradients (unless ``clip_grad_norm`` did), then step (fp16: skipped on
        every rank when any rank's gradients overflowed)."""
        self._reduce_experts()
        try:
            if self.scaler is None:
                return super().step(*args, **kwargs)
            from colossal.comm import all_reduce
            from colossal.optim import has_inf_or_nan

            self._unscale()
            reduce = functools.partial(all_reduce, tag="hybrid.ep.overflow")
            found_inf = has_inf_or_nan(self._grads(), None, all_reduce=reduce)
            self.scaler.update(found_inf)
            self.last_step_skipped = found_inf
            if not found_inf:
                self.optim.step(*args, **kwargs)
            self._unscaled = False
        finally:
            self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (a new step's expert gradients are not reduced yet)."""
        self._reduced = False
        super().zero_grad(set_to_none)


def expert_free_replicas(
    model: nn.Module, ep: ExpertParallel, dense_shapes, tp_size: int, pipe=None, prefix: str = ""
) -> dict[int, int]:
    """Parameter id -> how many ranks of the tp (pipeline: pp x tp) group hold each element of
    it, for every non-expert parameter this rank holds (the tied embedding's two pipeline copies
    count twice); experts are left out (their local shape is not a tp block of the dense one).
    ``prefix``: what the pipeline's names lack of the model's (a peft model's base prefix)."""
    if pipe is None:
        named = [(n, p) for n, p in model.named_parameters() if n not in ep.dense_shapes]
        return {id(p): multiplicity(p, dense_shapes[n], tp_size) for n, p in named}
    named = dict(pipe.named_parameters())
    tied = {id(named[n]) for n in pipe.tied_names}
    return {
        id(p): multiplicity(p, dense_shapes[prefix + n], tp_size) * (2 if id(p) in tied else 1)
        for n, p in named.items()
        if prefix + n not in ep.dense_shapes
    }


class ExpertPipelineOptimizer(PipelineOptimizer):
    """The hybrid plugin's optimizer under pipeline x expert parallelism (DDP-style dp): the
    pipeline step averaged the dense gradients over ``dp``; the expert gradients are reduced over
    ``edp`` here, once per step (before clipping and ``step``). Clipping uses the norm of the
    dense model over the whole world, each element weighted by ``c^(-1/p)`` where ``c`` is the
    number of ranks holding an equal copy of it (dense: ``dp`` times its pp x tp ``replicas``;
    experts: ``edp x tp``), so every element counts once. fp16's overflow check spans the world."""

    def __init__(
        self, optimizer, model: nn.Module, ep: ExpertParallel, replicas, dp_size: int, tp_size: int, scaler=None
    ) -> None:
        super().__init__(optimizer, replicas, None, scaler)  # None: the world
        self.model, self.ep = model, ep
        self.expert_ids = {id(p) for p in ep.expert_parameters(model)}
        self.dense_copies, self.expert_copies = dp_size, (dp_size // ep.groups.ep_size) * tp_size
        self._reduced = False

    def _reduce_experts(self) -> None:
        if not self._reduced:
            self.ep.reduce_expert_gradients(self.model)
            self._reduced = True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Reduce the expert gradients, then clip every gradient by the dense model's norm."""
        from colossal.optim import grad_norm

        self._reduce_experts()
        self._unscale()
        p = float(norm_type)
        grads = []
        for param in self.params:
            if param.grad is None:
                continue
            if id(param) in self.expert_ids:
                c = self.expert_copies
            else:
                c = self.dense_copies * self.replicas.get(id(param), 1)
            grads.append(param.grad if c == 1 or p == float("inf") else param.grad * c ** (-1.0 / p))
        total = grad_norm(grads, p, group=None)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(coef.to(param.grad.device))
        return total

    def step(self, *args, **kwargs) -> None:
        """Reduce the expert gradients (unless ``clip_grad_norm`` did), then step (fp16: skipped
        on every rank when any rank's gradients overflowed)."""
        self._reduce_experts()
        try:
            return super().step(*args, **kwargs)
        finally:
            self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (a new step's expert gradients are not reduced yet)."""
        self._reduced = False
        super().zero_grad(set_to_none)
