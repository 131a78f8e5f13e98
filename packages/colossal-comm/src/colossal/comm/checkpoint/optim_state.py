"""Full optimizer state <-> this rank's shards of flat buffers: the one path every sharded engine
(ZeRO 1-3 with offload, Gemini with its host and disk tiers) gathers and scatters state through.

[Note: one optimizer-state path]
A sharded engine keeps the optimizer state of a *flat buffer* of parameters: parameter ``i`` is
elements ``[offsets[i], offsets[i] + numel_i)`` of the buffer, and this rank holds elements
``[lo, hi)`` of it (a ZeRO shard, a Gemini chunk shard). What the engine knows per parameter is
described by a :class:`FlatShard`: its per-element states over ``[lo, hi)`` (``exp_avg``) and,
for each parameter, its scalar states (``step``; LARS's per-parameter ``scale``) or ``None`` for
"no state" (it never had a gradient), or nothing where this rank cannot know (it holds none of the
parameter and the rule is element-wise). The contract is ``torch.optim``'s:

* a parameter with no gradient history has **no entry** (not zeros without a ``step``);
* an entry always holds its scalar states together with its moments;
* loading checks every entry (unknown names, wrong sizes, a key set that differs within a buffer)
  and lists all mismatches in one ``ValueError`` before anything changes; a parameter without an
  entry is left without state, as ``torch.optim.Optimizer.load_state_dict`` leaves it.

:func:`gather_full_state` agrees, with one ``all_gather_object``, on the per-element keys and each
parameter's scalars (the ranks that hold it know them), then all-gathers one flat tensor per key
and buffer (``gather``, the engine's collective, as ``(hi - lo,)`` -> whole buffer).
:func:`scatter_full_state` is its inverse and communicates nothing: every rank takes its own
``[lo, hi)`` of the entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "FlatShard",
    "ShardState",
    "UNKNOWN",
    "check_full_state",
    "gather_full_state",
    "scatter_full_state",
    "per_element",
]

_UNKNOWN = object()


def per_element(v) -> bool:
    """Whether an optimizer state value is per element (a tensor of >= 1 dimension) rather than a scalar."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1


@dataclasses.dataclass
class FlatShard:
    """One flat buffer of parameters as this rank holds it (``[Note: one optimizer-state path]``)."""

    names: list[str]
    """Each parameter's name (the key of its entry)."""
    shapes: list[tuple[int, ...]]
    """Each parameter's shape."""
    offsets: list[int]
    """Each parameter's first element in the flat buffer."""
    lo: int
    """This rank's first element of the buffer."""
    hi: int
    """One past this rank's last element."""
    states: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-element states over ``[lo, hi)``, each a ``(hi - lo,)`` tensor (any values where no parameter
    has state)."""
    scalars: list = dataclasses.field(default_factory=list)
    """Per parameter: its scalar states (a dict, maybe empty, when it has state), ``None`` (no state),
    or :data:`UNKNOWN` (this rank cannot tell); left empty, every parameter is unknown."""

    def numel(self, i: int) -> int:
        """Elements of parameter ``i``."""
        n = 1
        for s in self.shapes[i]:
            n *= s
        return n


UNKNOWN = _UNKNOWN
"""``FlatShard.scalars`` value for a parameter this rank holds none of (an element-wise rule)."""


@dataclasses.dataclass
class ShardState:
    """This rank's share of a full state for one :class:`FlatShard` layout (what :func:`scatter_full_state` gives)."""

    states: dict[str, torch.Tensor]
    """Per-element states over ``[lo, hi)`` (zeros where a parameter has no state)."""
    scalars: list[dict | None]
    """Per parameter: its scalar states, or ``None`` for a parameter without an entry."""


def _agree(shards: list[FlatShard], group, distributed: bool) -> tuple[list[list[str]], list[list]]:
    """Per buffer: the per-element keys and every parameter's scalars, merged over ``group``."""
    mine = (
        [sorted(s.states) for s in shards],
        [{i: sc for i, sc in enumerate(s.scalars) if sc is not _UNKNOWN} for s in shards],
    )
    views = [mine]
    if distributed:
        views = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, mine, group=group)
    keys, scalars = [], []
    for b, s in enumerate(shards):
        keys.append(sorted({k for v in views for k in v[0][b]}))
        merged: list = [None] * len(s.names)
        for v in views:
            for i, sc in v[1][b].items():
                if sc is not None and merged[i] is None:  # a rank that stepped it knows its scalars
                    merged[i] = sc
        scalars.append(merged)
    return keys, scalars


def gather_full_state(
    shards: list[FlatShard],
    gather: Callable[[torch.Tensor, int], torch.Tensor],
    *,
    group=None,
    distributed: bool = True,
) -> dict[str, dict]:
    """``name -> entry`` (``torch.optim`` layout: scalars, then whole per-element tensors) of every
    parameter with state. ``gather(t, b)`` turns this rank's ``(hi - lo,)`` fp32 tensor of buffer
    ``b`` into the whole buffer (a collective over ``group``, or the identity when not sharded).
    Collective: every rank calls it with the same layouts; ``distributed=False`` for one process."""
    keys, scalars = _agree(shards, group, distributed and dist.is_initialized())
    out: dict[str, dict] = {}
    for b, s in enumerate(shards):
        entries = {i: {k: _copy(v) for k, v in sc.items()} for i, sc in enumerate(scalars[b]) if sc is not None}
        for k in keys[b]:
            local = s.states.get(k)
            local = torch.zeros(s.hi - s.lo) if local is None else local.detach().float()
            full = gather(local, b)
            for i, entry in entries.items():
                off, n = s.offsets[i], s.numel(i)
                entry[k] = full[off : off + n].view(s.shapes[i]).clone()
        out.update({s.names[i]: entry for i, entry in entries.items()})
    return out


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def check_full_state(shards: list[FlatShard], entries: dict[str, dict], what: str) -> None:
    """ValueError listing every problem of ``entries`` against the layouts (unknown names, sizes,
    per-element keys that differ within one buffer); decided alike on every rank."""
    known = {n: (s, i) for s in shards for i, n in enumerate(s.names)}
    problems = [f"unexpected entry {n!r} (no such parameter)" for n in entries if n not in known]
    for s in shards:
        sets = {}
        for i, n in enumerate(s.names):
            entry = entries.get(n)
            if entry is None:
                continue
            for k, v in entry.items():
                if per_element(v) and v.numel() != s.numel(i):
                    problems.append(
                        f"{n}/{k}: {v.numel()} elements (shape {tuple(v.shape)}), the parameter has "
                        f"{s.numel(i)} (shape {tuple(s.shapes[i])})"
                    )
            sets[n] = sorted(k for k, v in entry.items() if per_element(v))
        if len({tuple(v) for v in sets.values()}) > 1:
            problems.append(f"parameters sharing one flat buffer hold different state keys: {sets}")
    if problems:
        raise ValueError(f"cannot load this optimizer state into {what}:\n\t" + "\n\t".join(problems))


def scatter_full_state(
    shards: list[FlatShard], entries: dict[str, dict], *, what: str = "the engine"
) -> list[ShardState]:
    """This rank's :class:`ShardState` of each layout from ``name -> entry`` (the inverse of
    :func:`gather_full_state`; checked first by :func:`check_full_state`). Communicates nothing."""
    check_full_state(shards, entries, what)
    out = []
    for s in shards:
        states: dict[str, torch.Tensor] = {}
        scalars: list[dict | None] = []
        for i, n in enumerate(s.names):
            entry = entries.get(n)
            scalars.append(None if entry is None else {k: _copy(v) for k, v in entry.items() if not per_element(v)})
            if entry is None:
                continue
            a, b = max(s.lo, s.offsets[i]), min(s.hi, s.offsets[i] + s.numel(i))
            for k, v in entry.items():
                if per_element(v):
                    buf = states.setdefault(k, torch.zeros(s.hi - s.lo, dtype=v.dtype))
                    if a < b:
                        buf[a - s.lo : b - s.lo] = v.detach().reshape(-1)[a - s.offsets[i] : b - s.offsets[i]]
        out.append(ShardState(states, scalars))
    return out
