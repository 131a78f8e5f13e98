"""Prefetching the all-gather of the next chunks in the traced order (sharded data parallelism).

[Note: prefetch]
After warm-up the operator sequence of an iteration is known. Before operator ``j`` runs, the
chunks of the *window* ``W(j)`` must be gathered or in flight: the operator's own chunks plus the
first ``k(j)`` distinct chunks that later operators use (in traced order). The gathers of window
chunks not gathered yet are issued asynchronously (``comm.all_gather(async_op=True)``) right after
the operator's own chunks are fetched, so they overlap its compute; the next :meth:`fetch` of such
a chunk waits for it. Gathered chunks that leave the window are released.

Collectives pair by issue order, so every rank must issue the same gathers in the same order:
whether a chunk is gathered when an operator starts may not depend on one rank's memory. Hence

* ``k(j)`` comes from a plan made once, at the end of warm-up: each rank computes the largest
  ``k(j) <= prefetch`` whose window fits its budget next to the traced non-model and gradient-buffer
  bytes of operator ``j`` and the bytes the placement policy never evicts (``fixed_bytes``: the
  device-homed chunks of the static policy) (:func:`plan_depths`), then the ranks take the minimum over the group
  (one all-reduce), after checking they traced the same chunk sequence;
* window chunks are protected from eviction (evictions stay local decisions: they move shards
  between tiers, never a collective);
* when an iteration departs from the trace (other chunks at some operator, more operators, an
  operator outside autograd), prefetching stops for the rest of the iteration, in-flight gathers
  are waited for and released, and chunks are gathered on demand as during warm-up. A departure
  that is the same on every rank keeps the ranks paired.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch

import colossal.comm as comm
from colossal.comm import plan_depths, upcoming_chunks
from colossal.gemini.chunk import Chunk

__all__ = ["plan_depths", "agree_on_depths", "build_prefetcher", "Prefetcher"]


class Prefetcher:
    """Runs a prefetch plan over one iteration: windows, asynchronous gathers, releases (see the note)."""

    def __init__(self, manager, ops: Sequence[tuple[int, ...]], depths: Sequence[int]):
        self.m = manager
        self.ops = [tuple(o) for o in ops]
        self.ahead = [
            u[:k] for u, k in zip(upcoming_chunks(self.ops), depths)
        ]  # chunks prefetched at each op, in order
        self.windows = [frozenset(o) | frozenset(a) for o, a in zip(self.ops, self.ahead)]
        self.window: frozenset[int] = frozenset()  # chunks gathered or in flight for the current window
        self.active = True

    def keep(self, i: int, chunks: Sequence[Chunk]) -> frozenset[int]:
        """Chunks to keep gathered at operator ``i`` (``-1``: outside autograd); stops on a departure."""
        ids = tuple(c.id for c in chunks)
        self.active = self.active or i == 0  # a new iteration re-arms (after an evaluation pass, say)
        if self.active and 0 <= i < len(self.ops) and ids == self.ops[i]:
            return self.windows[i]
        self.active = False
        return frozenset(ids)

    def enter(self, window: frozenset[int]) -> None:
        """Release prefetched chunks that left the window (waiting for their gathers first)."""
        for cid in self.window - window:
            chunk = self.m.chunks[cid]
            if not chunk.in_use:
                self.m.release(chunk)
        self.window = window

    def issue(self, i: int, make_room: Callable[[int, set[int]], None]) -> None:
        """Start the gathers of the window chunks of operator ``i`` that are not gathered yet."""
        if not self.active or not 0 <= i < len(self.ops):
            return
        for cid in self.ahead[i]:
            chunk = self.m.chunks[cid]
            need = self.m.device_bytes_to_fetch(chunk)
            if need:
                make_room(need, set(self.window))
                self.m.prefetch(chunk)


def agree_on_depths(manager, ops: Sequence[tuple[int, ...]], depths: list[int]) -> list[int]:
    """The minimum of every rank's depths (collective); raises on every rank if the traces differ."""
    dev = manager.device.device
    seq = ",".join(";".join(map(str, op)) for op in ops).encode()
    digest = zlib.crc32(seq) & 0x7FFFFFFF
    probe = torch.tensor([len(ops), -len(ops), digest, -digest], dtype=torch.int64, device=dev)
    comm.all_reduce(probe, "max", manager.group, tag="gemini.plan")
    if probe[0] != -probe[1] or probe[2] != -probe[3]:
        raise RuntimeError(
            "data-parallel ranks traced different operator/chunk sequences in warm-up (this rank: "
            f"{len(ops)} operators); prefetching needs the same sequence on every rank: pass prefetch=0"
        )
    ks = torch.tensor(depths, dtype=torch.int64, device=dev)
    comm.all_reduce(ks, "min", manager.group, tag="gemini.plan")
    return [int(k) for k in ks.tolist()]


def build_prefetcher(ddp, o_device_bytes: int) -> Prefetcher:
    """The plan of the traced iteration (collective over the data-parallel group; see the note)."""
    m, trace = ddp.manager, ddp.trace
    ops = [op.chunk_ids for op in trace.ops]

    def fits(j: int, ids: list[int]) -> bool:
        op = trace.ops[j]
        # recomputations gather these too; held chunks stay gathered (see [Note: held chunks] in ddp.py)
        ids = list(dict.fromkeys([*ids, *op.recompute_chunk_ids, *op.held_chunk_ids]))
        held = sum(m.chunks[c].nbytes + m.chunks[c].shard_nbytes for c in ids)  # payload + shard on the device
        # a new gradient buffer is made room for on top of the traced ones (make_room in _grad_ready)
        grad = m.chunks[0].nbytes if op.label.startswith("bwd:") else 0
        fixed = ddp.policy.fixed_bytes(set(ids))  # what the policy will not evict to make room (static homes)
        return held + fixed + o_device_bytes + op.non_model_bytes + op.pinned_bytes + grad <= m.device.budget

    depths = agree_on_depths(m, ops, plan_depths(ops, ddp.config.prefetch, fits))
    return Prefetcher(m, ops, depths)
