"""Layer-wise optimizers (LAMB, LARS) through ZeRO: per-parameter views of the master shards.

[Note: layer-wise optimizers]
Element-wise optimizers (Adam, SGD) can step one flat master shard per buffer: the result does
not depend on where parameters begin and end. LAMB and LARS scale each *parameter's* update by
``||w|| / ||x||``, so they must see parameters, and the norms must be of the whole parameter,
not of the piece this rank holds. An optimizer that exposes ``norm_reducer`` (the
``colossal.optim`` layer-wise contract, see its ``[Note: sharded trust ratios]``) therefore gets,
instead of one flat master per buffer, one 1-D view of the master per original parameter: the
part of that parameter inside this rank's shard, empty when none is. Every rank hands the
optimizer the same number of views in the same order, so the per-parameter squared norms line
up, and ``norm_reducer`` sums them over the shard group (one all-reduce per step, through
``colossal.comm`` so it is a comm event). Replicas of an HSDP layout hold identical shards, so
the sum runs over the shard group only. Gradients are attached as the matching views of the
master's ``.grad`` right before the step and dropped right after.

Element-wise optimizers switch to the same views (without a norm reducer) the first time a step
has a parameter without a gradient: see ``[Note: parameters without a gradient]`` in
``optimizer.py``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from colossal.comm import all_reduce
from colossal.optim import group_norm_reducer
from colossal.zero._flat_param import FlatParam

__all__ = ["is_layerwise", "ParamShardViews"]


def is_layerwise(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer follows the layer-wise contract (it has a ``norm_reducer`` attribute)."""
    return hasattr(optimizer, "norm_reducer")


def _span(flat: FlatParam, index: int) -> tuple[int, int]:
    """Where parameter ``index`` lies inside this rank's shard, as ``(a, b)`` (``a == b``: nowhere)."""
    lo = flat.offsets[index] - flat.shard_start
    a = min(max(lo, 0), flat.shard_numel)
    b = min(max(lo + flat.numels[index], 0), flat.shard_numel)
    return a, max(a, b)


class ParamShardViews:
    """Per-parameter views of every master shard (see ``[Note: layer-wise optimizers]``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, flats: list[FlatParam], group, layerwise: bool = True) -> None:
        if layerwise:
            if optimizer.norm_reducer is not None:
                raise ValueError(
                    f"{type(optimizer).__name__}.norm_reducer is already set; build it with norm_reducer=None: "
                    "ZeroOptimizer reduces the per-parameter norms over its shard group itself"
                )
            reduce = functools.partial(all_reduce, tag="zero.norms")
            optimizer.norm_reducer = group_norm_reducer(group, all_reduce=reduce)
        self.optimizer = optimizer
        self.flats = [f for f in flats if f.master is not None]
        self.spans = {id(f): [_span(f, i) for i in range(len(f.params))] for f in self.flats}
        self.views = {id(f): [f.master.detach()[a:b] for a, b in self.spans[id(f)]] for f in self.flats}

    def group_params(self, group_index: int) -> list[Tensor]:
        """The views the optimizer's param group ``group_index`` holds (buffer order, then parameter order)."""
        return [v for f in self.flats if f.group_index == group_index for v in self.views[id(f)]]

    def attach_grads(self, without: dict[int, set[int]] | None = None) -> None:
        """Give every view the matching slice of its master's ``.grad`` (right before the step);
        ``without[id(flat)]``: indices of parameters that got no gradient (their views get none,
        so the optimizer leaves them, and their states, untouched, as ``torch.optim`` does)."""
        without = without or {}
        for f in self.flats:
            grad, skip = f.master.grad, without.get(id(f), ())
            for i, (v, (a, b)) in enumerate(zip(self.views[id(f)], self.spans[id(f)], strict=True)):
                v.grad = grad[a:b] if grad is not None and i not in skip else None

    def detach_grads(self) -> None:
        """Drop the views' gradients (they would keep the reduced gradient shards alive)."""
        for views in self.views.values():
            for v in views:
                v.grad = None

    def flat_state(self, flat: FlatParam) -> dict:
        """The optimizer state of ``flat`` in the element-wise layout: per-element states as one
        ``(shard_numel,)`` tensor (zeros in the padding), scalar states (``step``) once."""
        states = [self.optimizer.state.get(v, {}) for v in self.views[id(flat)]]
        first = next((s for s in states if s), None)
        if first is None:
            return {}
        out = {}
        for key, v0 in first.items():
            if isinstance(v0, Tensor) and v0.dim() >= 1:
                buf = torch.zeros(flat.shard_numel, dtype=v0.dtype, device=v0.device)
                for s, (a, b) in zip(states, self.spans[id(flat)], strict=True):
                    if s:
                        buf[a:b].copy_(s[key].reshape(-1))
                out[key] = buf
            else:
                out[key] = v0
        return out

    def set_flat_state(self, flat: FlatParam, state: dict, scalars: list[dict | None] | None = None) -> None:
        """Inverse of :meth:`flat_state`: split ``(shard_numel,)`` states into the views' states;
        ``scalars`` per parameter (``None``: that parameter gets no state; default: every view
        takes ``state``'s scalars)."""
        shared = {k: v for k, v in state.items() if not _per_element(v)}
        for i, (v, (a, b)) in enumerate(zip(self.views[id(flat)], self.spans[id(flat)], strict=True)):
            sc = shared if scalars is None else scalars[i]
            if sc is None:
                self.optimizer.state.pop(v, None)
                continue
            per = {k: s[a:b].clone() for k, s in state.items() if _per_element(s)}
            self.optimizer.state[v] = {**{k: _copy(x) for k, x in sc.items()}, **per}

    def param_states(self, flat: FlatParam) -> list[dict | None]:
        """Each parameter's scalar states (LARS keeps a per-parameter ``scale``; Adam's ``step`` is
        shared), ``None`` for a parameter without state (it never had a gradient)."""
        out = []
        for view in self.views[id(flat)]:
            st = self.optimizer.state.get(view)
            out.append({k: v for k, v in st.items() if not _per_element(v)} if st else None)
        return out

    def state_tensors(self, flat: FlatParam) -> list[Tensor]:
        """Every optimizer state tensor of ``flat``'s views (for memory accounting)."""
        return [t for v in self.views[id(flat)] for t in self.optimizer.state.get(v, {}).values() if torch.is_tensor(t)]


def _per_element(v) -> bool:
    return isinstance(v, Tensor) and v.dim() >= 1


def _copy(v):
    return v.detach().clone() if isinstance(v, Tensor) else v
