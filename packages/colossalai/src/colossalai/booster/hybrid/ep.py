"""Expert parallelism for the Booster: shard every MoE layer's experts over an ``ep`` group,
reduce expert gradients over their own group, and keep checkpoints in dense form.

This is the colossalai-side piece that ``HybridParallelPlugin(ep_size=...)`` composes with DDP
or ZeRO (see ``[Note: hooking expert parallelism into the hybrid plugin]``); it works on its own
in a user's loop too::

    ep = apply_expert_parallel(model, ep_size=2)          # every rank, after building the model
    ddp = DDP(model, process_group=ep.groups.dp)          # expert params were marked as ignored
    loss = criterion(ddp(x), y) + model.aux_loss()
    loss.backward()
    ep.reduce_expert_gradients(model)                      # experts: sum over edp / dp size
    optimizer.step()
    state = ep.full_state_dict(model)                      # every expert under its dense name

[Note: hooking expert parallelism into the hybrid plugin]
1. Mesh: split the plugin's ``dp`` axis into ``("edp", dp // ep)`` and ``("ep", ep)`` (ep inner,
   so an ep group is consecutive ranks); the dense data-parallel group becomes
   ``mesh.product_group("edp", "ep")``. Pass that group as ``dp_group`` here.
2. ``configure``: after tensor/sequence parallel conversion and before DDP/ZeRO, call
   :func:`apply_expert_parallel` (it swaps each ``MoE`` for its local slice in place).
3. DDP: call ``DDP._set_params_and_buffers_to_ignore_for_model(model, ep.expert_param_names)``
   before wrapping (this function already does), so DDP averages dense gradients only; the
   plugin's optimizer wrapper calls ``ep.reduce_expert_gradients(model)`` before ``step``.
   ZeRO 1/2: give the engine the dense parameters over ``dp`` and a second engine the expert
   parameters over ``edp`` (with gradients pre-divided by ``ep``, as here).
4. State: ``model_state_dict``/``load_model_state_dict`` route expert names through
   :meth:`ExpertParallel.to_portable` / :meth:`ExpertParallel.to_local` (the same way tp
   names go through the shard index), so a checkpoint holds every expert under its dense name
   and loads with any ``ep`` or any other plugin.
5. The Booster adds ``model.aux_loss()`` to the criterion's loss when the model has MoE layers
   (switchable), and the CLI reads ``model.moe_stats()`` for the progress line.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel as DDP

from colossal.comm import all_gather, all_reduce
from colossal.moe import ExpertGroups, MoE, expert_groups, moe_layers

__all__ = ["ExpertParallel", "apply_expert_parallel"]


@dataclasses.dataclass(slots=True)
class ExpertParallel:
    """What :func:`apply_expert_parallel` did: the groups and the experts' dense shapes."""

    groups: ExpertGroups
    """``ep`` (experts split), ``edp`` (same experts), ``dp`` (dense gradients)."""
    dense_shapes: dict[str, torch.Size]
    """Expert parameter name -> its full shape over all experts (dim 0 = experts)."""

    @property
    def expert_param_names(self) -> list[str]:
        """Names of the parameters split over ``ep`` (DDP must ignore them)."""
        return list(self.dense_shapes)

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

    def to_portable(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of expert parameter ``name`` (gathered over ``ep``); others as they are."""
        if name not in self.dense_shapes or self.groups.ep_size == 1:
            return local
        return all_gather(local.contiguous(), group=self.groups.ep, tag="hybrid_ep.state")

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full tensor of ``name`` (others as they are)."""
        if name not in self.dense_shapes:
            return full
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


def apply_expert_parallel(model: nn.Module, ep_size: int, dp_group: ProcessGroup | None = None) -> ExpertParallel:
    """Split every ``colossal.moe.MoE`` of ``model`` over ``ep_size`` ranks, in place.

    Each layer must hold all its experts (built with no ``ep_group``); rank ``r`` of its ep group
    keeps experts ``r * E/ep .. (r+1) * E/ep - 1`` (:meth:`MoE.from_dense`). Validates every layer
    and the sizes before creating any group, identically on every rank. Marks the expert
    parameters for DDP to ignore. Call on every rank of ``dp_group`` (default: the world).
    """
    dp_size = dist.get_world_size(dp_group)
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or dp_size % ep_size:
        raise ValueError(f"ep_size={ep_size!r} must be a positive int dividing the data-parallel size {dp_size}")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no colossal.moe.MoE layer")
    for n, m in layers.items():
        if m.ep_size != 1:
            raise ValueError(f"{n} is already split over ep={m.ep_size}; build the model with all experts")
        if m.config.num_experts % ep_size:
            raise ValueError(f"{n}: num_experts={m.config.num_experts} is not divisible by ep_size={ep_size}")
    groups = expert_groups(ep_size, dp_group)
    shapes = {f"{n}.experts.{p}": t.shape for n, m in layers.items() for p, t in m.experts.named_parameters()}
    for n, m in layers.items():
        _replace(model, n, MoE.from_dense(m, groups.ep))
    assert len(moe_layers(model)) == len(layers)
    DDP._set_params_and_buffers_to_ignore_for_model(model, list(shapes))
    return ExpertParallel(groups=groups, dense_shapes=shapes)
