"""Stage 3: parameters sharded at rest, gathered per unit (a module) just before its forward and
its backward, freed right after; the next unit's gather is started early (prefetch).

[Note: units and hooks]
A unit is the root module or a submodule picked by the wrap policy (default: each child of an
``nn.ModuleList``, i.e. each transformer block). A parameter belongs to the innermost unit that
encloses every module owning it (see ``[Note: shared parameters]``). Hooks:

* forward pre-hook: gather the unit (waiting on a prefetch if one is in flight), start
  gathering the next ``prefetch`` units in the recorded forward order;
* forward hook: free the unit (the root stays gathered: its backward begins right away) and
  hook the outputs' gradients, which fire just before the unit's backward;
* output-gradient hook (pre-backward): gather the unit again, prefetch the ``prefetch`` units
  before it in forward order (the next ones to run backward);
* the gradient reducer calls back when every parameter of the unit has its gradient: the unit
  is freed; the end-of-backward callback frees whatever is left (unused or frozen parameters).

[Note: shared parameters]
A unit's parameters are gathered only around that unit's forward and backward. A parameter owned by
several modules (an input embedding tied to an output head) is used in the forward of each owner,
and an owner that is not a unit runs inside the forward of its innermost enclosing unit. So the
parameter must live in the unit that encloses *all* of its owners' units (their lowest common
ancestor in the unit tree, as FSDP does), else it is freed while another owner computes with it: an
embedding tied to a ``nn.Linear`` head with ``wrap_policy=(nn.Linear,)`` used to put the shared
weight in the head's unit, and the root's embedding read freed storage.

[Note: recomputation in backward]
Activation checkpointing runs a unit's forward again inside backward, just before that unit's own
backward. Its pre-forward hook must not prefetch the next unit in forward order (whose backward has
already run: it would be gathered for nothing and held to the end of backward), and its
post-forward hook must not free the unit (its backward needs it next, and would gather it again).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from colossal.comm import all_gather
from colossal.zero._flat_param import FlatParam, ShardedState

__all__ = ["Unit", "Stage3Engine", "find_units"]


class Unit:
    """One module's gather/free unit: its flat buffers (one per optimizer param group)."""

    def __init__(self, module: nn.Module, flats: list[FlatParam], is_root: bool):
        self.module, self.flats, self.is_root = module, flats, is_root
        self.fwd_index: int | None = None  # position in the recorded forward order
        self.in_backward = False  # gathered for this backward pass already
        self.pending: dict[int, object] = {}  # flat index -> all-gather handle
        self.frozen = any(len(f.trainable) < len(f.params) for f in flats)

    def complete(self) -> bool:
        """Every trainable parameter has its gradient for this backward pass."""
        return all(len(f.ready) == len(f.trainable) for f in self.flats)


def find_units(model: nn.Module, policy) -> list[nn.Module]:
    """Root first, then the policy's submodules in registration order."""
    if policy is None:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        picked = {id(c) for ml in lists for c in ml.children()}
        return [model] + [m for m in model.modules() if id(m) in picked and m is not model]
    pred = policy if callable(policy) and not isinstance(policy, tuple) else (lambda m: isinstance(m, policy))
    return [model] + [m for m in model.modules() if m is not model and pred(m)]


def assign_params(model: nn.Module, units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Parameters per unit (registration order): the innermost unit enclosing every module that
    owns the parameter (see ``[Note: shared parameters]``)."""
    index = {id(m): i for i, m in enumerate(units)}
    parent = [0] * len(units)  # unit -> enclosing unit (the root encloses itself)
    enclosing: dict[int, set[int]] = {}  # module -> innermost units containing it (one per path)

    def walk(module: nn.Module, cur: int, seen: set[int]) -> None:
        i = index.get(id(module), cur)
        if i != cur:
            parent[i] = parent[i] or cur
        enclosing.setdefault(id(module), set()).add(i)
        for child in module.children():
            if id(child) not in seen:  # a module cannot contain itself; guards odd graphs
                walk(child, i, seen | {id(child)})

    walk(model, 0, {id(model)})
    users: dict[nn.Parameter, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(p, set()).update(enclosing[id(module)])
    out: list[list[nn.Parameter]] = [[] for _ in units]
    for p in model.parameters():
        out[_common_unit(users[p], parent)].append(p)
    return out


def _common_unit(found: set[int], parent: list[int]) -> int:
    """The innermost unit whose chain of enclosing units every unit in ``found`` goes through."""

    def chain(u: int) -> list[int]:
        out = [u]
        while out[-1] != 0:
            out.append(parent[out[-1]])
        return out

    chains = [chain(u) for u in sorted(found)]
    return next(u for u in chains[0] if all(u in c for c in chains[1:]))


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (the recomputation of activation
    checkpointing runs a unit's forward there)."""
    return torch._C._current_graph_task_id() != -1


class Stage3Engine:
    """Installs and runs the stage-3 hooks over a list of :class:`Unit`."""

    def __init__(self, units: list[Unit], group: ProcessGroup | None, prefetch: int, reshard_root: bool = False):
        self.units, self.group, self.prefetch, self.reshard_root = units, group, prefetch, reshard_root
        self.order: list[Unit] = []  # forward order, recorded during the first forward
        self.order_frozen = False
        self.reducer = None  # set by the optimizer; gives ensure_callback()
        self._handles = []
        for unit in units:
            for flat in unit.flats:
                flat.unit = unit
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))

    # -- gather / free ------------------------------------------------------------------------
    def start_unshard(self, unit: Unit) -> None:
        """Issue the all-gathers of every sharded buffer of ``unit`` (asynchronously)."""
        for i, flat in enumerate(unit.flats):
            if flat.state is ShardedState.SHARDED:
                # Gather straight into the unit's own storage when dtypes agree (no extra buffer).
                out = flat.alloc_full() if flat.shard.dtype == flat.full.dtype else None
                with torch.profiler.record_function("colossal.zero::all_gather_params"):
                    unit.pending[i] = all_gather(
                        flat.shard, self.group, async_op=True, tag="zero.all_gather_params", out=out
                    )
                flat.state = ShardedState.GATHERING

    def wait_unshard(self, unit: Unit) -> None:
        """Gather ``unit`` (if needed) and wait: its parameters are full views afterwards."""
        self.start_unshard(unit)
        for i, flat in enumerate(unit.flats):
            if flat.state is ShardedState.GATHERING:
                flat.to_unsharded(unit.pending.pop(i).wait())  # (padded_numel,)

    def reshard(self, unit: Unit) -> None:
        """Free the full buffers of ``unit`` (only its shards remain)."""
        for flat in unit.flats:
            if flat.state is ShardedState.UNSHARDED:
                flat.to_sharded()

    # -- hooks --------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        def hook(module, args):
            if not self.order_frozen and unit.fwd_index is None:
                unit.fwd_index = len(self.order)
                self.order.append(unit)
            self.wait_unshard(unit)
            recompute = _in_backward()  # [Note: recomputation in backward]
            if self.prefetch and self.order_frozen and not recompute and unit.fwd_index is not None:
                for nxt in self.order[unit.fwd_index + 1 : unit.fwd_index + 1 + self.prefetch]:
                    self.start_unshard(nxt)

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module, args, output):
            if unit.is_root:
                self.order_frozen = True
            recompute = _in_backward()  # its backward runs next: keep it gathered for it
            if (not unit.is_root or self.reshard_root or not torch.is_grad_enabled()) and not recompute:
                self.reshard(unit)
            if torch.is_grad_enabled():
                unit.in_backward = False
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda grad, u=unit: self._pre_backward(u))
            return output

        return hook

    def _pre_backward(self, unit: Unit) -> None:
        self.reducer.ensure_callback()
        if unit.in_backward:
            return
        unit.in_backward = True
        self.wait_unshard(unit)
        here = unit.fwd_index if unit.fwd_index is not None else 1
        lowest = 0 if self.reshard_root else 1  # the root stays gathered unless resharded after forward
        for prev in range(here - 1, max(here - 1 - self.prefetch, lowest - 1), -1):
            self.start_unshard(self.order[prev])

    def on_flat_complete(self, flat: FlatParam) -> None:
        """Reducer callback: free the unit once all its gradients are in (none frozen)."""
        unit = flat.unit
        if not unit.frozen and unit.complete():
            self.reshard(unit)

    def on_backward_end(self) -> None:
        """Free every unit still gathered (root, unused or frozen parameters)."""
        for unit in self.units:
            if any(f.state is ShardedState.GATHERING for f in unit.flats):
                self.wait_unshard(unit)  # a prefetch whose backward never came
            self.reshard(unit)
            unit.in_backward = False

    def remove(self) -> None:
        """Unregister the module hooks."""
        for h in self._handles:
            h.remove()
