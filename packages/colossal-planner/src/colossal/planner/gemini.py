"""Gemini's memory per tier, predicted from a traced step: chunk packing, placement and one steady step.

:func:`gemini_memory` restates the accounting rules of ``colossal.gemini`` (``GeminiDDP`` +
``GeminiOptimizer``) without importing it, and replays them on a :class:`~colossal.planner.trace.ModelTrace`:

1. **Chunks** (``chunk_manager.py``): parameters packed in registration order into chunks of one size,
   searched to minimise padding when not given, rounded up to a multiple of the ranks a chunk is split over;
   frozen parameters apart from trainable ones ([Note: frozen parameters]).
2. **Operators** (``ddp.py`` [Note: operators]): one per module owning parameters, forward and backward,
   with the non-model bytes the warm-up measures between one operator's start and the next one's. The
   trace is per dispatched op; [Note: operators from a trace] says how they are grouped into modules.
3. **Warm-up** (``warmup.py``, ``placement.py``): the gradient-buffer bytes each operator pins, the
   placement of the optimizer blocks (static fractions, or the auto margin) and the prefetch plan.
4. **Steady state** (``placement.py``, ``prefetch.py``, ``ddp.py``): three iterations after warm-up are
   replayed with the policy's fetches, evictions (Belady or LRU of host-homed chunks), prefetches, gradient
   buffers and the resident fast path; the device peak is ``GeminiStats.peak_device_bytes``' rule: the
   largest accounted model bytes plus the non-model bytes reserved for the operator, sampled at each
   operator start and at each new gradient buffer.

[Note: operators from a trace]
Gemini's unit of placement is one module's forward or backward, the trace's is one dispatched op. A
module's forward starts at its first matmul (the op whose FLOPs are ``2 * tokens * numel`` of the
module's largest parameter, searched in order inside its ZeRO-3 unit's forward span), or, for a module
without one (embeddings, norms), at its unit's start or right after the previous module's start. Its
backward starts at the first such matmul after the previous module's last gradient (the gradients come
from ``ModelTrace.grad_op``), and ends with its own last gradient. A matmul after the last module's
forward whose FLOPs match a parameter of an embedding is an output head tied to it (GPT's ``lm_head``):
the trace lists a tied parameter once, so this is the only sign of that module. Ops between two starts
belong to the earlier operator, as in the engine, where a record stays open until the next hook fires.

[Note: frozen parameters]
Parameters that do not require grad (a frozen base under LoRA) are packed apart from the trainable ones
(``chunk_manager._pack_apart``: two ``pack`` streams, chunks sorted by their first parameter). A frozen
chunk is working data only (``chunk.py`` [Note: frozen chunks]): no fp32 master, gradient shard, gradient
buffer or optimizer states (block 0 bytes, never placed, never aliased, never reduced), so the host holds
its working shard alone. Static ``offload_optim_frac`` and the disk plan's master, gradient and states
homes count the trainable chunks only (static: their last fractions; auto: ``trainable[on_host:]``); the
working homes (``offload_param_frac``, the shard homes) count every chunk.

[Note: frozen modules in backward]
A frozen module runs a backward operator when its output needs a gradient, i.e. when its input does (the
trace has no gradient to show it). Autograd runs the backward in reverse creation order, so a frozen
module with a matmul takes the first matmul of its shape after the backward of every later module and
before that of the earlier trainable ones (none there: its input needs no gradient); one without (a
norm) runs right after the later modules' backward when its parameters are per-channel vectors and an
earlier module has a backward (a table such as a position embedding reads indices: none). From its first
backward operator to its last, a frozen chunk is in use (its tensors stay HOLD_AFTER_BWD while autograd
holds views of it for a later operator): it is neither released nor evicted between them, and warm-up
records it among the operators' held chunks (``OpRecord.held_chunk_ids``).

[Note: what is approximated]
* Non-model bytes are the trace's (the meta-device step), not the warm-up's measurement: on the
  validation GPTs they agree to 0.3 % at the peak; some attention-backward operators read up to one
  ``B * T * C`` activation higher in the trace.
* Operator boundaries come from [Note: operators from a trace] and [Note: frozen modules in backward];
  held chunks (``OpRecord.held_chunk_ids``: a tensor waiting for its gradient whose saved views outlive
  its operator) are modelled for frozen chunks only (a tied embedding's is not), nor is
  ``Chunk.in_use`` beyond the current operator's chunks.
* Iterations that depart from the trace (skipped modules, extra micro-batches) are not replayed.
* Disk tier: the host's working-shard cache is capped at the auto allowance (the second-level Belady
  spill order is not replayed), one shard read from disk is counted in flight, and the I/O buffer pool is
  its bound (three blocks in flight, direct I/O); the engine's pool depends on how its I/O threads overlap.
* Optimizer states are ``layout.states`` fp32 tensors per parameter element (element-wise optimizers; scalar
  states such as AdamW's ``step`` are not accounted, as in ``GeminiOptimizer.block_bytes``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from colossal.comm import pack, plan_depths, search_chunk_size, upcoming_chunks
from colossal.planner.layout import Layout, TierBytes
from colossal.planner.trace import ModelTrace

__all__ = [
    "ChunkPlan",
    "gemini_memory",
    "gemini_min_device_bytes",
    "gemini_operator_needs",
    "plan_chunks",
]

DISK_ALIGN = 4096
"""Bytes every disk region and I/O buffer is rounded to (``disk.py`` ``_ALIGN``)."""
_AUTO_BLOCK_BYTES_PER_ELEM = 16
"""``disk.plan``: the auto disk plan sizes an optimizer block as 16 bytes per shard element (AdamW)."""


# -- chunks: colossal.comm.pack / search_chunk_size, the rules chunk_manager.py applies ----------------
@dataclasses.dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How Gemini packs a model's parameters into chunks (``ChunkManager.__init__``)."""

    size: int
    """Elements per chunk (a multiple of ``world``)."""
    world: int
    """Ranks each chunk is split over (1 with ``keep_gathered``)."""
    itemsize: int
    """Bytes per working element."""
    chunks: tuple[tuple[int, ...], ...]
    """Parameter indices per chunk, packed in order (``colossal.comm.pack``)."""
    numels: tuple[int, ...]
    """Elements per parameter, in registration order."""
    frozen: tuple[bool, ...] = ()
    """Per chunk: whether it holds frozen parameters only (working data alone, see [Note: frozen
    parameters]); empty means none is."""

    def is_frozen(self, c: int) -> bool:
        """Whether chunk ``c`` is frozen (``Chunk.frozen``)."""
        return bool(self.frozen) and self.frozen[c]

    @property
    def trainable(self) -> list[int]:
        """The chunks with gradients, fp32 masters and optimizer states (``ChunkManager.trainable``)."""
        return [c for c in range(len(self.chunks)) if not self.is_frozen(c)]

    @property
    def shard(self) -> int:
        """Elements of one rank's shard of a chunk (``Chunk.shard_size``)."""
        return self.size // self.world

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a gathered chunk in the working dtype."""
        return self.size * self.itemsize

    @property
    def shard_bytes(self) -> int:
        """Bytes of one rank's working shard (``Chunk.shard_nbytes``)."""
        return self.shard * self.itemsize

    def used(self, c: int) -> int:
        """Elements of chunk ``c`` that hold parameters (the rest is padding)."""
        return sum(self.numels[i] for i in self.chunks[c])

    def slice_elems(self, c: int, rank: int) -> int:
        """Parameter elements of chunk ``c`` inside ``rank``'s shard (the optimizer's slices there)."""
        lo = rank * self.shard
        return max(0, min(self.used(c), lo + self.shard) - lo)

    def block_bytes(self, c: int, rank: int, states: int) -> int:
        """``GeminiOptimizer.block_bytes``: the fp32 master and gradient of the whole shard, and
        ``states`` fp32 tensors over the shard's parameter elements (the optimizer steps slices of
        real tensors only, so padding has no state; scalar states are not counted); 0 for a frozen chunk."""
        if self.is_frozen(c):
            return 0
        return 8 * self.shard + 4 * states * self.slice_elems(c, rank)


def plan_chunks(trace: ModelTrace, layout: Layout) -> ChunkPlan:
    """The chunks of ``trace``'s parameters under ``layout`` (``ChunkManager.__init__``): the chunk size is
    searched over every parameter, then the trainable and the frozen ones are packed apart
    (``chunk_manager._pack_apart``, see [Note: frozen parameters])."""
    world = 1 if layout.keep_gathered else layout.dp
    numels = tuple(p.numel for p in trace.params)
    size = layout.chunk_size or search_chunk_size(numels, align=world)
    size = -(-size // world) * world  # divisible by the ranks a chunk is split over
    itemsize = layout.precision.itemsize
    packed = _pack_apart(numels, [p.requires_grad for p in trace.params], size)
    chunks = tuple(tuple(idx) for idx, _ in packed)
    frozen = tuple(f for _, f in packed)
    return ChunkPlan(size=size, world=world, itemsize=itemsize, chunks=chunks, numels=numels, frozen=frozen)


def _pack_apart(numels: Sequence[int], grads: Sequence[bool], size: int) -> list[tuple[list[int], bool]]:
    """``chunk_manager._pack_apart``: the trainable and the frozen parameters packed apart (``pack`` over
    each stream, in order), the chunks as ``(indices, frozen)`` sorted by their first parameter."""
    out = []
    for frozen in (False, True):
        ids = [i for i, g in enumerate(grads) if g != frozen]
        out += [([ids[j] for j in idx], frozen) for idx in pack([numels[i] for i in ids], size)]
    return sorted(out, key=lambda c: c[0][0])


# -- operators (see [Note: operators from a trace]) --------------------------------------------------------
@dataclasses.dataclass(slots=True)
class _Op:
    """One Gemini operator rebuilt from the trace (``tracer.OpRecord``'s fields that matter here)."""

    label: str
    chunk_ids: tuple[int, ...]
    start: int  # first dispatched op of the trace in it
    non_model: int = 0
    pinned: int = 0  # gradient-buffer bytes pinned during it in warm-up (OpRecord.pinned_bytes)
    recompute: tuple[int, ...] = ()  # chunks recomputed forwards gather inside it (activation checkpointing)
    held: tuple[int, ...] = ()  # frozen chunks in use next to its own ([Note: frozen modules in backward])
    grads: list[int] = dataclasses.field(default_factory=list)  # chunk of each gradient arriving in it

    @property
    def backward(self) -> bool:
        """Whether it is a backward operator."""
        return self.label.startswith("bwd:")


@dataclasses.dataclass(slots=True)
class _Module:
    name: str
    params: list[int]
    sig: int  # FLOPs of its matmul: 2 * tokens * numel of its largest parameter
    unit: int
    fwd: int = -1  # dispatched op its forward starts at
    matched: bool = False  # its forward matmul was found
    bwd_end: int = -1  # dispatched op of its last gradient (-1: frozen, no gradient)
    vector: bool = False  # every parameter a per-channel vector (a norm's), not a table or a matrix

    @property
    def frozen(self) -> bool:
        """Whether no parameter of it gets a gradient (see [Note: frozen parameters])."""
        return self.bwd_end < 0


def _modules(trace: ModelTrace) -> list[_Module]:
    by_name: dict[str, _Module] = {}
    for i, p in enumerate(trace.params):
        if trace.grad_op[i] < 0 and p.requires_grad:
            continue  # an unused module runs no operator (its chunk is reduced at the end of backward)
        name = p.name.rsplit(".", 1)[0] if "." in p.name else "<root>"
        mod = by_name.setdefault(name, _Module(name, [], 0, p.unit))
        mod.params.append(i)
    largest = max((p.numel for p in trace.params), default=0)
    for mod in by_name.values():
        mod.sig = 2 * trace.tokens * max(trace.params[i].numel for i in mod.params)
        mod.bwd_end = max(trace.grad_op[i] for i in mod.params)
        mod.vector = all(trace.params[i].numel ** 2 <= largest for i in mod.params)
    return list(by_name.values())


def _find(flops: Sequence[float], sig: int, lo: int, hi: int) -> int:
    return next((j for j in range(lo, hi) if flops[j] == sig), -1)


def _forward_starts(trace: ModelTrace, mods: list[_Module]) -> list[_Module]:
    """Set each module's forward start; returns the tied heads found after the last module."""
    end = trace.backward_start
    firsts = {}
    for k, mod in enumerate(mods):
        if mod.unit != 0 and mod.unit not in firsts:
            firsts[mod.unit] = k
    anchors = {k: trace.unit_forward[u][0] for u, k in firsts.items()}
    p = 0
    for k, mod in enumerate(mods):
        bound = min([a for kk, a in anchors.items() if kk > k] + [end])
        lo = max(p, anchors.get(k, p))
        j = _find(trace.flops, mod.sig, lo, bound)
        mod.matched = j >= 0
        mod.fwd = j if mod.matched else min(lo, max(end - 1, 0))
        p = mod.fwd + 1
    heads = []
    plain = [m for m in mods if not m.matched]  # embeddings and norms: no matmul of their own
    for j in range(p, end):
        tied = next((m for m in plain if trace.flops[j] and m.sig == trace.flops[j]), None)
        if tied is not None:
            head = _Module(f"{tied.name}(tied head)", list(tied.params), tied.sig, 0, j, True)
            first_grad = min((m.bwd_end for m in mods if not m.frozen), default=trace.ops)
            last = [jj for jj in range(trace.backward_start, first_grad) if trace.flops[jj] == head.sig]
            last = last[:2]  # its input's gradient and its weight's: later ones are other modules' (frozen ones)
            head.bwd_end = last[-1] if last else trace.backward_start
            heads.append(head)
            p = j + 1
    return heads


def _backward_starts(trace: ModelTrace, mods: list[_Module]) -> list[tuple[_Module, int]]:
    """Each module's backward start, in backward order; a frozen module without one is left out."""
    order = sorted((m for m in mods if not m.frozen), key=lambda m: (m.bwd_end, m.fwd))
    out, prev = [], trace.backward_start - 1
    for mod in order:
        j = _find(trace.flops, mod.sig, prev + 1, mod.bwd_end + 1) if mod.matched else -1
        if j < 0:  # no matmul (a norm, an embedding): its backward is the op that makes its first gradient
            j = min([trace.grad_op[i] for i in mod.params if trace.grad_op[i] > prev] + [mod.bwd_end])
        out.append((mod, max(j, prev + 1) if out else j))
        prev = max(prev, _backward_end(trace, mod))
    out += _frozen_backward_starts(trace, mods, out)
    return sorted(out, key=lambda ms: (ms[1], -ms[0].fwd))


def _backward_end(trace: ModelTrace, mod: _Module) -> int:
    """The last op of a trainable module's backward: its last gradient, or the matmul for its input's
    gradient when that comes right after its weight's (a Linear without bias: ``mm`` for the weight, two
    transposes, ``mm`` for the input), which a module of the same shape must not take for its own."""
    e = mod.bwd_end
    if not mod.matched or trace.flops[e] != mod.sig:
        return e
    for j in range(e + 1, min(e + 5, trace.ops)):
        if trace.flops[j]:
            return j if trace.flops[j] == mod.sig else e
    return e


def _frozen_backward_starts(
    trace: ModelTrace, mods: list[_Module], trained: list[tuple[_Module, int]]
) -> list[tuple[_Module, int]]:
    """[Note: frozen modules in backward]: the backward starts of the frozen modules that have one."""
    ends = [(m.fwd, _backward_end(trace, m)) for m, _ in trained]  # a later-forward module's backward is done
    starts = [(m.fwd, s) for m, s in trained]
    out: list[tuple[_Module, int]] = []
    frozen = sorted((m for m in mods if m.frozen), key=lambda m: -m.fwd)
    for mod in (m for m in frozen if m.matched):  # reverse forward order: the backward's order
        lo = max([e for f, e in ends if f > mod.fwd] + [trace.backward_start - 1])
        hi = min([s for f, s in starts if f < mod.fwd] + [trace.ops])
        j = _find(trace.flops, mod.sig, lo + 1, hi)
        if j >= 0:  # its input needs a gradient: the matmul that makes it
            out.append((mod, j))
            ends.append((mod.fwd, j))
    for mod in reversed([m for m in frozen if not m.matched]):  # forward order: upstream ones decided first
        upstream = any(f < mod.fwd for f, _ in ends)
        if mod.vector and upstream:
            lo = max([e for f, e in ends if f > mod.fwd] + [trace.backward_start - 1])
            out.append((mod, min(lo + 1, trace.ops - 1)))
            ends.append((mod.fwd, lo + 1))
    return out


def _operators(trace: ModelTrace, plan: ChunkPlan) -> list[_Op]:
    """Gemini's operator sequence of one step, with non-model bytes and gradient arrivals."""
    chunk_of = {i: c for c, idx in enumerate(plan.chunks) for i in idx}
    mods = _modules(trace)
    heads = _forward_starts(trace, mods)
    ids = lambda m: tuple(sorted({chunk_of[i] for i in m.params}))  # noqa: E731
    ops = [_Op(f"fwd:{m.name}", ids(m), m.fwd) for m in sorted(mods + heads, key=lambda m: m.fwd)]
    ops += [_Op(f"bwd:{m.name}", ids(m), s) for m, s in _backward_starts(trace, mods + heads)]
    for k, op in enumerate(ops):  # starts never go back: an operator holds the ops up to the next start
        op.start = max(op.start, ops[k - 1].start if k else 0)
    bounds = [op.start for op in ops[1:]] + [trace.ops]
    for op, hi in zip(ops, bounds, strict=True):
        lo = 0 if op is ops[0] else op.start
        op.non_model = max(trace.live[lo:hi], default=0)
    starts = [op.start for op in ops]
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for i, g in enumerate(trace.grad_op):
        if g >= 0:
            arrivals.setdefault(max(k for k, s in enumerate(starts) if s <= g or k == 0), []).append((g, i))
    for k, got in arrivals.items():
        # inside one operator the hooks fire latest-made first: a Linear's weight gradient passes the
        # transpose's backward node after its bias's AccumulateGrad has run (autograd's ready queue)
        ops[k].grads = [chunk_of[i] for _, i in sorted(got, reverse=True)]
    if trace.activation_checkpointing:
        _recomputes(trace, ops, mods, chunk_of)
    _frozen_holds(ops, plan)
    return ops


def _frozen_holds(ops: list[_Op], plan: ChunkPlan) -> None:
    """``OpRecord.held_chunk_ids`` of frozen chunks: from its first backward operator to its last, a frozen
    chunk is in use (``Chunk.in_use``: a tensor of it left its backward in HOLD_AFTER_BWD, where no gradient
    moves it on, while autograd still holds views of the chunk that a later backward operator reads)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for c in op.chunk_ids if op.backward else ():
            if plan.is_frozen(c):
                first.setdefault(c, i)
                last[c] = i
    for i, op in enumerate(ops):
        op.held = tuple(c for c in sorted(first) if first[c] < i < last[c] and c not in op.chunk_ids)


def _recomputes(trace: ModelTrace, ops: list[_Op], mods: list[_Module], chunk_of: dict[int, int]) -> None:
    """Activation checkpointing: the first backward operator of each recomputed unit (a block) gathers
    every chunk of that unit for the recomputed forward (``ddp.py`` [Note: recomputation])."""
    unit_chunks: dict[int, set[int]] = {}
    for m in mods:
        if m.unit:
            unit_chunks.setdefault(m.unit, set()).update(chunk_of[i] for i in m.params)
    unit_of = {f"bwd:{m.name}": m.unit for m in mods}
    seen: set[int] = set()
    for op in ops:
        u = unit_of.get(op.label, 0)
        if op.backward and u and u not in seen:
            seen.add(u)
            op.recompute = tuple(sorted(unit_chunks[u] - set(op.chunk_ids)))


# -- the engine's rules on one rank ------------------------------------------------------------------------
class _Rank:
    """The model-data accounting of one rank (``ChunkManager`` + ``DeviceTier``/``HostTier``), replayed."""

    def __init__(self, plan: ChunkPlan, layout: Layout, rank: int, budget: int, ops: list[_Op]):
        self.plan, self.layout, self.rank, self.budget, self.ops = plan, layout, rank, budget, ops
        self.moved = self.disk_read = self.disk_written = 0  # bytes of the iteration being replayed
        n = len(plan.chunks)
        self.n = n
        self.sharded = plan.world > 1
        self.dp = layout.dp
        self.states = layout.states
        self.unit = plan.shard_bytes if self.sharded else plan.chunk_bytes  # resident working bytes per chunk
        self.tensors = [len(idx) for idx in plan.chunks]
        self.blocks = [plan.block_bytes(c, rank, self.states) for c in range(n)]
        self.trainable = plan.trainable  # chunks with a master, a gradient and states (ChunkManager.trainable)
        self.peak_nm = max((op.non_model for op in ops), default=0)
        self.gathered = [False] * n
        self.shard_dev = [False] * n  # sharded: the working shard is on the device tier
        self.n_gathered = self.n_shard_dev = 0  # counts of the two above (accounting in O(1))
        self.buffer = [False] * n
        self.o_dev: set[int] = set()  # chunks whose optimizer block is on the device (set by place())
        self.o_bytes = 0
        self.host_block_bytes = 0
        self.on_disk: dict[int, set[str]] = {c: set() for c in range(n)}
        self.disk_shard: set[int] = set()  # working shards on the disk tier now
        self.disk_homed: frozenset[int] = frozenset()  # static: shards whose home is the disk
        self.allowance: int | None = None  # auto with a disk tier: host bytes working shards may hold
        self.io = 0  # host bytes of the disk tier's I/O buffers
        self.host_homed: set[int] = set()
        self.aliased = [False] * n
        self.buffers = 0
        self.new_grad = 0
        self.protected: frozenset[int] = frozenset()
        self.window: frozenset[int] = frozenset()
        self.held: frozenset[int] = frozenset()  # frozen chunks in use between backward operators (_Op.held)
        self.last_use: dict[int, int] = {}
        self.peak = 0
        self.need = 0  # largest device bytes asked for beyond the budget (0: every step fitted)
        self.host_peak = 0
        self.uses: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            for c in op.chunk_ids:
                self.uses.setdefault(c, []).append(i)

    # accounting ----------------------------------------------------------------------------------------
    def place(self, o_dev: set[int]) -> None:
        """Put the optimizer blocks of ``o_dev`` on the device, the others on the host (``finish_warmup``)."""
        self.o_dev = {c for c in o_dev if not self.plan.is_frozen(c)}  # a frozen chunk has no block to move
        self.o_bytes = sum(self.blocks[c] for c in self.o_dev)
        total = 0
        for c in self.trainable:
            if c not in self.o_dev:  # master and gradient shards, states; parts on disk excluded
                d = self.on_disk[c]
                total += 4 * self.plan.shard * (("master" not in d) + ("grad" not in d))
                total += 0 if "states" in d else self.blocks[c] - 8 * self.plan.shard
        self.host_block_bytes = total

    @property
    def used(self) -> int:
        """Accounted model bytes on the device tier (``DeviceTier.used_bytes``)."""
        p = self.plan
        working = self.n_gathered * p.chunk_bytes + (self.n_shard_dev * p.shard_bytes if self.sharded else 0)
        return working + self.buffers + self.o_bytes

    def host_working(self) -> int:
        """Host bytes of working shards (``ChunkManager.host_working_bytes``)."""
        on_dev = self.n_shard_dev if self.sharded else self.n_gathered
        held = (self.n - on_dev - len(self.disk_shard)) * self.plan.shard_bytes
        if self.allowance is not None:  # shards past the allowance spill to disk (ChunkManager.host_room)
            held = min(held, self.allowance // self.plan.shard_bytes * self.plan.shard_bytes)
        return held

    def note_host(self) -> None:
        """Record the host tier's accounted bytes now."""
        self.host_peak = max(self.host_peak, self.host_working() + self.host_block_bytes)

    def reserve(self, i: int) -> int:
        """``GeminiDDP._reserve``: the traced non-model bytes of operator ``i`` and its traced gradient
        buffers not live yet (the largest traced non-model peak outside the trace)."""
        if not 0 <= i < len(self.ops):
            return self.peak_nm
        op = self.ops[i]
        return op.non_model + max(0, op.pinned - self.buffers - self.new_grad)

    def sample(self, i: int) -> None:
        """``GeminiDDP._sample``: model bytes now + the non-model bytes reserved (the stats' peak)."""
        self.peak = max(self.peak, self.used + self.reserve(i))

    # moves ---------------------------------------------------------------------------------------------
    def fetch_bytes(self, c: int) -> int:
        """``ChunkManager.device_bytes_to_fetch``."""
        if self.gathered[c]:
            return 0
        return self.plan.chunk_bytes + (self.plan.shard_bytes if self.sharded and not self.shard_dev[c] else 0)

    def resident(self, c: int) -> int:
        """``ChunkManager.resident_bytes``."""
        g = self.plan.chunk_bytes if self.gathered[c] else 0
        return g + (self.plan.shard_bytes if self.sharded and self.shard_dev[c] else 0)

    def fetch(self, c: int) -> None:
        """``ChunkManager.fetch``: the shard to the device (from disk through the host), then gathered."""
        if self.gathered[c]:
            return
        if self.sharded and not self.shard_dev[c]:
            self.moved += self.plan.shard_bytes  # host -> device (the gather itself is communication)
        elif not self.sharded:
            self.moved += self.plan.chunk_bytes
        if c in self.disk_shard:
            self.disk_read += self.plan.shard_bytes if self.sharded else self.plan.chunk_bytes
        self.disk_shard.discard(c)
        self.gathered[c] = True
        self.n_gathered += 1
        if self.sharded and not self.shard_dev[c]:
            self.shard_dev[c] = True
            self.n_shard_dev += 1

    def _drop(self, c: int) -> None:
        self.gathered[c] = False
        self.n_gathered -= 1
        self.aliased[c] = False  # the master gets its own buffer back ([Note: aliased masters])

    def release(self, c: int) -> None:
        """``ChunkManager.release``: drop a sharded chunk's gathered payload (no-op unsharded)."""
        if self.sharded and self.gathered[c]:
            self._drop(c)

    def evict(self, c: int) -> None:
        """``ChunkManager.evict``: working data to the host tier (a disk-homed shard goes home to disk)."""
        if not self.sharded:
            if not self.gathered[c]:
                return
            self._drop(c)
        else:
            self.release(c)
            if not self.shard_dev[c]:
                return
            self.shard_dev[c] = False
            self.n_shard_dev -= 1
        self.moved += self.plan.shard_bytes if self.sharded else self.plan.chunk_bytes  # device -> host
        if c in self.disk_homed:  # straight to its disk region (disk.evict_to_disk): no host copy
            self.disk_shard.add(c)
            self.disk_written += self.plan.shard_bytes if self.sharded else self.plan.chunk_bytes
        self.note_host()

    # placement policy ----------------------------------------------------------------------------------
    def next_use(self, c: int, i: int) -> float:
        """``placement._next_use`` on the traced sequence, cyclic (the next iteration's first use)."""
        uses = self.uses.get(c, ())
        for p in uses:
            if p > i:
                return p
        return uses[0] + len(self.ops) if uses else math.inf

    def victim(self, protect: set[int], i: int) -> int | None:
        """Auto: the chunk used furthest ahead (Belady); static: the least recently used host-homed one."""
        cands = [
            c
            for c in range(self.n)
            if self.resident(c) and c not in protect and c not in self.protected and c not in self.held
        ]
        if self.layout.placement == "static":
            cands = [c for c in cands if c in self.host_homed]
            return min(cands, key=lambda c: self.last_use.get(c, -1), default=None)
        return max(cands, key=lambda c: (self.next_use(c, i), c), default=None)

    def make_room(self, nbytes: int, protect: set[int], i: int) -> None:
        """``PlacementPolicy.make_room``; where nothing may go, the need is recorded (the engine raises)."""
        while self.used + nbytes + self.reserve(i) > self.budget:
            v = self.victim(protect, i)
            if v is None:
                self.need = max(self.need, self.used + nbytes + self.reserve(i))
                return
            self.evict(v)

    def after_op(self, used: Sequence[int], coming: frozenset[int] | set[int]) -> None:
        """``PlacementPolicy.after_op`` (+ ``StaticPolicy``: host-homed chunks go back after their use)."""
        for c in used:
            if c not in coming and c not in self.held:  # a held chunk is in use (Chunk.in_use)
                self.release(c)
                if c in self.host_homed:
                    self.evict(c)


def _warmup_pinned(r: _Rank) -> None:
    """``OpRecord.pinned_bytes``: gradient-buffer bytes live during each operator of the warm-up, where every
    optimizer block is on the host (no gradient goes straight to a device fp32 shard)."""
    got = [0] * r.n
    live: set[int] = set()
    inflight: list[int] = []
    order = r.trainable[::-1]  # replicated chunks reduce in descending id ([Note: fixed reduction order])
    ready: set[int] = set()
    nxt = 0
    cur = 0
    for op in r.ops:
        pinned = cur
        for c in op.grads:
            if c not in live:
                live.add(c)
                pinned = max(pinned, len(live) * r.plan.chunk_bytes)
            got[c] += 1
            if got[c] < r.tensors[c]:
                continue
            ready.add(c)
            launch = [c]
            if r.dp > 1 and not r.sharded:
                launch = []
                while nxt < len(order) and order[nxt] in ready:
                    launch.append(order[nxt])
                    nxt += 1
            for cc in launch:
                if r.dp > 1:  # one reduction in flight: the previous one finishes when the next starts
                    for done in inflight:
                        live.discard(done)
                    inflight = [cc]
                else:
                    live.discard(cc)
        op.pinned = pinned
        cur = len(live) * r.plan.chunk_bytes


def _payload(r: _Rank, op: _Op) -> int:
    """``warmup._payload``: gathered payloads a sharded operator holds (its own chunks and recomputed ones)."""
    return len(set(op.chunk_ids) | set(op.recompute) | set(op.held)) * r.plan.chunk_bytes if r.sharded else 0


def _place_blocks(r: _Rank) -> int:
    """``warmup.finish_warmup``: the optimizer blocks on the device; returns the static check's need (0 when
    it passes, or under the auto policy)."""
    n, lay = r.n, r.layout
    if lay.placement == "static":  # the working homes over every chunk, the blocks over the trainable ones
        r.host_homed = set(range(n - round(lay.offload_param_frac * n), n))
        train, k = r.trainable, len(r.trainable)
        r.place({c for c in train[: k - round(lay.offload_optim_frac * k)] if not r.on_disk[c]})
        return _static_need(r)
    peak = max((op.non_model + op.pinned + _payload(r, op) for op in r.ops), default=0)
    margin = r.budget - peak - r.unit * n  # [Note: optimizer blocks in the auto policy]
    chosen = set()
    for c in range(n):
        if r.blocks[c] <= margin:
            chosen.add(c)
            margin -= r.blocks[c]
    r.place({c for c in chosen if not r.on_disk[c]})
    return 0


def _static_need(r: _Rank) -> int:
    """``warmup._static_check``: the device bytes each operator needs under fixed homes (largest)."""
    homed = r.unit * (r.n - len(r.host_homed))
    o_bytes = r.o_bytes
    need = 0
    for op in r.ops:
        ids = set(op.chunk_ids) | set(op.recompute) | set(op.held)
        visiting = r.unit * len(ids & r.host_homed)
        need = max(need, op.non_model + op.pinned + o_bytes + homed + visiting + _payload(r, op))
    return need


# -- prefetch (prefetch.py) ------------------------------------------------------------------------------
def _prefetch_plan(r: _Rank, depth: int) -> tuple[list[list[int]], list[frozenset[int]]]:
    """``prefetch.plan_depths`` with ``build_prefetcher``'s fit: per operator, the chunks gathered ahead and
    the window kept gathered."""
    ops = [op.chunk_ids for op in r.ops]
    upcoming = upcoming_chunks(ops)
    o_bytes = r.o_bytes
    p = r.plan

    def fits(j: int, ids: list[int]) -> bool:
        op = r.ops[j]
        ids = list(dict.fromkeys([*ids, *op.recompute, *op.held]))
        held = len(ids) * (p.chunk_bytes + p.shard_bytes)
        grad = p.chunk_bytes if op.backward else 0
        fixed = r.unit * sum(1 for c in range(r.n) if c not in r.host_homed and c not in ids)
        fixed = fixed if r.layout.placement == "static" else 0
        return held + fixed + o_bytes + op.non_model + op.pinned + grad <= r.budget

    ks = plan_depths(ops, depth, fits)
    ahead = [u[:k] for u, k in zip(upcoming, ks, strict=True)]
    return ahead, [frozenset(o) | frozenset(a) for o, a in zip(ops, ahead, strict=True)]


# -- one steady-state iteration ----------------------------------------------------------------------------
class _Step:
    """Replays iterations after warm-up on a :class:`_Rank` (``GeminiDDP`` hooks and ``_take_grad``)."""

    def __init__(self, r: _Rank, prefetch: int):
        self.r = r
        self.ahead, self.windows = ([], [])
        if r.sharded and prefetch > 0:
            self.ahead, self.windows = _prefetch_plan(r, prefetch)
        self.direct = {c for c in r.trainable if r.dp == 1 and c in r.o_dev}  # ChunkManager.direct_grad
        static_homes = r.layout.placement == "static" and r.host_homed
        buffers = sum(r.plan.chunk_bytes for c in r.trainable if c not in self.direct)
        self.fast_need = 0 if static_homes else max(1, r.peak_nm + buffers)  # GeminiDDP.plan_fast_path
        self.fast = False  # the last iteration ran on the resident fast path
        self._new_pass()

    def _new_pass(self) -> None:
        self.got = [0] * self.r.n  # gradients in per chunk this backward
        self.pending: list[int] = []  # the reduction in flight
        self.ready: set[int] = set()  # replicated: chunks complete, waiting for their turn
        self.nxt = 0  # replicated: position in the fixed reduction order

    def resident(self) -> bool:
        """``GeminiDDP._resident``: every chunk on the device and room for all buffers and the peak."""
        r = self.r
        if r.sharded or self.fast_need <= 0 or r.used + self.fast_need > r.budget:
            return False
        return all(r.gathered)

    def run(self) -> int:
        """One iteration; returns its peak device bytes (``GeminiStats.peak_device_bytes``)."""
        r = self.r
        r.peak = 0
        self._new_pass()
        self.fast = self.resident()
        if self.fast:  # [Note: resident fast path]: one sample at the forward, one per new gradient buffer
            r.peak = r.used + r.peak_nm
            if not (r.dp == 1 and all(r.aliased[c] for c in r.trainable)):  # [Note: native gradients]
                for op in r.ops:
                    for c in op.grads:
                        self._take_grad(c, -1, set())
        else:
            self._operators()
        self._end_backward()
        self._refresh()
        return r.peak

    def _operators(self) -> None:
        """Every operator's ``_begin_op`` (release, fetch, prefetch, sample), then its gradients."""
        r = self.r
        current: tuple[int, ...] = ()
        for i, op in enumerate(r.ops):
            keep = self.windows[i] if self.windows else frozenset(op.chunk_ids)
            r.protected = keep
            r.held = frozenset(op.held)
            r.after_op(current, keep)
            if self.windows:
                for c in r.window - keep:
                    r.release(c)
                r.window = keep
            r.make_room(sum(r.fetch_bytes(c) for c in op.chunk_ids), set(op.chunk_ids), i)
            for c in op.chunk_ids:
                r.fetch(c)
                r.last_use[c] = i
            for c in self.ahead[i] if self.ahead else ():
                need = r.fetch_bytes(c)
                if need:
                    r.make_room(need, set(r.window), i)
                    r.fetch(c)
            r.note_host()
            r.sample(i)
            self._recompute(op, i)  # the recomputed forward runs before the operator's gradients exist
            for c in op.grads:
                self._take_grad(c, i, set(op.chunk_ids))
            current = op.chunk_ids

    def _recompute(self, op: _Op, i: int) -> None:
        """Recomputed forwards inside a backward operator fetch (and pin) their chunks, then let them go."""
        r = self.r
        if not op.recompute:
            return
        r.make_room(sum(r.fetch_bytes(c) for c in op.recompute), set(op.chunk_ids) | set(op.recompute), i)
        for c in op.recompute:
            r.fetch(c)
        r.sample(i)
        r.after_op(op.recompute, r.protected | set(op.chunk_ids))

    def _take_grad(self, c: int, i: int, protect: set[int]) -> None:
        """A parameter's gradient goes into its chunk: a new buffer is made room for (and sampled); a chunk
        whose gradients are all in is reduced (``GeminiDDP._take_grad``, ``ChunkManager.add_grad``)."""
        r = self.r
        new = not r.buffer[c] and c not in self.direct
        if new:
            r.new_grad = r.plan.chunk_bytes
            r.make_room(r.plan.chunk_bytes, protect, i)
            r.new_grad = 0
            r.buffer[c] = True
            r.buffers += r.plan.chunk_bytes
            r.sample(i)
        self.got[c] += 1
        if self.got[c] == r.tensors[c]:
            self._reduce(c)

    def _reduce(self, c: int) -> None:
        """``GeminiDDP._reduce``."""
        r = self.r
        if r.dp > 1 and not r.sharded:  # replicated: descending chunk id ([Note: fixed reduction order])
            self.ready.add(c)
            order = r.trainable[::-1]
            while self.nxt < len(order) and order[self.nxt] in self.ready:
                self._launch(order[self.nxt])
                self.nxt += 1
            return
        self._launch(c)

    def _launch(self, c: int) -> None:
        """One reduction in flight (``GeminiDDP._launch_reduce``); on one rank it finishes at once."""
        for done in self.pending:
            self._finish(done)
        self.pending = []
        if c in self.direct:
            return
        if self.r.dp > 1:
            self.pending = [c]
        else:
            self._finish(c)

    def _finish(self, c: int) -> None:
        """``ChunkManager.finish_reduce``: the gradient buffer is refunded."""
        r = self.r
        if r.buffer[c]:
            r.buffer[c] = False
            r.buffers -= r.plan.chunk_bytes

    def _end_backward(self) -> None:
        """``GeminiDDP._backward_end``: the last reduction finishes, the policy lets every chunk go."""
        r = self.r
        for c in range(r.n):  # _reduce_rest: chunks with unused parameters are reduced now too
            self._finish(c)
        r.held = frozenset()  # Chunk.after_frozen_backward: frozen tensors leave HOLD_AFTER_BWD
        if not self.fast:  # the fast path has no module hooks, so no after_op either
            r.after_op(range(r.n), set())
        r.window = frozenset()
        r.protected = frozenset()
        r.note_host()

    def _refresh(self) -> None:
        """``ChunkManager.refresh_working``: a resident fp32 chunk with its block on the device becomes its
        own master ([Note: aliased masters])."""
        r = self.r
        fp32 = r.plan.itemsize == 4 and r.layout.precision == torch.float32
        for c in r.trainable:  # a frozen chunk has no master (ChunkManager.can_alias)
            if fp32 and not r.sharded and not r.layout.disk and r.gathered[c] and c in r.o_dev:
                r.aliased[c] = True


# -- disk tier (disk.py) -----------------------------------------------------------------------------------
def _round(n: int) -> int:
    return -(-n // DISK_ALIGN) * DISK_ALIGN


def _io_buffer_bytes(plan: ChunkPlan, states: int = 2) -> int:
    """``disk.buffer_bytes``: three block sets (master, gradient, states) and two staging buffers."""
    per = _round(plan.shard * 4) + DISK_ALIGN
    return 3 * (2 + states) * per + 2 * (_round(plan.chunk_bytes) + DISK_ALIGN)


def _io_pool_bytes(r: _Rank, homes: dict[str, set[int]]) -> int:
    """Host bytes of the disk tier's I/O buffers once the pool has grown to what a step uses at once
    (``disk._Buffers``: one pool per buffer size, charged when a buffer is made, never given back).

    The streaming step holds three consecutive streamed blocks (read ahead, stepped, written back; fewer
    when fewer chunks stream, as with frozen chunks, which stream nothing), each one buffer per
    disk-resident part (master, gradient, each state); reads and writes of working shards go through
    staging buffers (two, ``disk.buffer_bytes``), as do the setup's writes. Direct I/O is assumed (tensors
    torch allocates are not 4 KiB aligned, so every tensor write stages); the pool's real size depends on
    how the I/O threads overlap and may stay a buffer or two below this bound."""
    p = r.plan
    parts = [len(r.on_disk[c] - {"states"}) + r.states * ("states" in r.on_disk[c]) for c in range(r.n)]
    parts = [k for k in parts if k]  # the streamed blocks, in chunk order (disk.stream_step)
    fp32 = max((sum(parts[j : j + 3]) for j in range(len(parts))), default=0)
    staging = 2 if homes["shard"] or any(homes["master"]) else 0
    if p.shard_bytes == p.shard * 4:  # fp32 working shards share the pool of the fp32 blocks
        return max(fp32, staging) * (_round(p.shard * 4) + DISK_ALIGN)
    return fp32 * (_round(p.shard * 4) + DISK_ALIGN) + staging * (_round(p.shard_bytes) + DISK_ALIGN)


def _disk_plan(r: _Rank) -> tuple[dict[str, set[int]], int | None]:
    """``disk.plan``: which chunk parts live on disk and, for ``auto``, the host bytes working shards may hold."""
    lay, n, p = r.layout, r.n, r.plan
    last = lambda frac, cs: set(cs[len(cs) - round(frac * len(cs)) :])  # noqa: E731
    train = r.trainable  # a frozen chunk has no master, gradient or states to home
    if lay.placement == "static":
        homes = {
            "shard": last(lay.disk_param_frac, list(range(n))),
            "master": last(lay.disk_param_frac, train),
            "grad": last(lay.disk_grad_frac, train),
            "states": last(lay.disk_optim_frac, train),
        }
        return homes, None
    if lay.host_budget is None:
        raise ValueError("Layout(placement='auto', disk=True) needs host_budget (Gemini's host_memory_budget)")
    avail = lay.host_budget - _io_buffer_bytes(p)
    block = p.shard * _AUTO_BLOCK_BYTES_PER_ELEM
    on_host = max(0, int(avail // 2 // block))
    disk_blocks = set(train[on_host:])
    homes = {"shard": set(range(n)), "master": disk_blocks, "grad": disk_blocks, "states": disk_blocks}
    return homes, avail - min(on_host, len(train)) * block


def _disk_file_bytes(r: _Rank, homes: dict[str, set[int]]) -> int:
    """Bytes of the rank's scratch file: ``disk.plan_bytes`` (the preallocation, two states assumed) or the
    regions the run allocates when the optimizer keeps more states (each rounded to 4 KiB)."""
    p, total, planned = r.plan, 0, 0
    for c in range(r.n):
        alias = p.itemsize == 4 and c in homes["shard"] and c in homes["master"]  # fp32: shard = master region
        shard = _round(p.shard_bytes) * (c in homes["shard"] and not alias)
        fp32 = _round(p.shard * 4)
        total += shard + fp32 * ((c in homes["master"]) + (c in homes["grad"]) + r.states * (c in homes["states"]))
        planned += shard + fp32 * ((c in homes["master"]) + (c in homes["grad"]) + 2 * (c in homes["states"]))
    return max(total, planned)


# -- host tier ---------------------------------------------------------------------------------------------
def _host_setup_peak(r: _Rank) -> int:
    """Host bytes while the chunks are materialised (``ChunkManager._materialise`` then ``disk.home``): each
    chunk's working shard, fp32 master and fp32 gradient land on the host; the disk-homed parts then leave,
    and the shard too when it is disk-homed or past the auto allowance."""
    p, host, peak, working = r.plan, 0, 0, 0
    for c in range(r.n):
        add = 8 * p.shard * (not p.is_frozen(c)) + p.shard_bytes  # a frozen chunk: its working shard only
        peak = max(peak, host + add)
        d = r.on_disk[c]
        host += add - 4 * p.shard * (("master" in d) + ("grad" in d))
        working += p.shard_bytes
        if c in r.disk_homed or (r.allowance is not None and working > r.allowance):
            host -= p.shard_bytes
            working -= p.shard_bytes
    staging = _round(p.shard * 4) + DISK_ALIGN if any(r.on_disk.values()) else 0  # the first disk writes
    return peak + staging


def _host_warmup_peak(r: _Rank) -> int:
    """Host bytes at the end of warm-up (``finish_warmup``): every working shard on the host (or disk), the
    first step's I/O buffers, and each block's states charged on the host (``move_block``: the first step
    made them there) before a device-bound block moves with its master and gradient."""
    host = r.host_working() + r.host_block_bytes + 8 * r.plan.shard * len(r.o_dev) + r.io
    peak = host
    for c in sorted(r.o_dev):
        peak = max(peak, host + r.blocks[c] - 8 * r.plan.shard)
        host -= 8 * r.plan.shard
    return peak


# -- entry points ------------------------------------------------------------------------------------------
def _setup(trace: ModelTrace, layout: Layout, budget: int, rank: int) -> tuple[_Rank, dict, int | None]:
    if layout.engine != "gemini":
        raise ValueError(f"gemini_memory needs Layout(engine='gemini'), got engine={layout.engine!r}")
    if layout.disk and layout.keep_gathered:
        raise NotImplementedError("Gemini's disk tier is not supported with keep_gathered=True")
    plan = plan_chunks(trace, layout)
    ops = _operators(trace, plan)
    r = _Rank(plan, layout, rank, budget, ops)
    homes, allowance = {}, None
    if layout.disk:
        homes, allowance = _disk_plan(r)
        for c in range(r.n):
            r.on_disk[c] = {k for k in ("master", "grad", "states") if c in homes[k]}
        r.disk_homed = frozenset(homes["shard"]) if layout.placement == "static" else frozenset()
        r.disk_shard = set(r.disk_homed)
        r.allowance = allowance
        r.io = _io_pool_bytes(r, homes)
    _warmup_pinned(r)
    return r, homes, allowance


def gemini_operator_needs(trace: ModelTrace, layout: Layout) -> list[tuple[str, int]]:
    """Per Gemini operator, ``(label, bytes)`` the warm-up check asks of the device there
    (``GeminiDDP._close_record``: the operator's own chunks, recomputed ones, the gradient buffers live
    during it, its non-model bytes); the engine raises ``BudgetExceededError`` at the first one above
    the budget. Labels are the engine's (``"fwd:blocks.0.mlp.fc_in"``); a tied output head is
    ``"fwd:<embedding>(tied head)"`` (see [Note: operators from a trace])."""
    r, _, _ = _setup(trace, layout, 1 << 62, 0)
    fetch = r.plan.chunk_bytes + (r.plan.shard_bytes if r.sharded else 0)
    return [
        (op.label, len(set(op.chunk_ids) | set(op.recompute) | set(op.held)) * fetch + op.pinned + op.non_model)
        for op in r.ops
    ]


def gemini_min_device_bytes(trace: ModelTrace, layout: Layout) -> int:
    """The fewest device bytes with which Gemini runs ``layout`` (below it the engine raises
    ``BudgetExceededError``): the largest warm-up check of an operator (:func:`gemini_operator_needs`,
    which covers ``GeminiDDP._check_setup``'s one module's chunks) and, under the static policy,
    ``warmup._static_check`` (the fixed homes and device blocks next to every operator's needs)."""
    need = max((n for _, n in gemini_operator_needs(trace, layout)), default=0)
    if layout.placement == "static":
        r, _, _ = _setup(trace, layout, 1 << 62, 0)
        _place_blocks(r)
        need = max(need, _static_need(r))
    return need


def _simulate(trace: ModelTrace, layout: Layout, budget: int, rank: int) -> tuple[_Rank, dict[str, int]]:
    r, homes, allowance = _setup(trace, layout, budget, rank)
    static_need = _place_blocks(r)
    setup_host = _host_setup_peak(r)
    warm_host = _host_warmup_peak(r)
    r.host_peak = 0
    step = _Step(r, layout.prefetch)
    peaks, fast = [], 0
    for _ in range(3):  # iterations 1, 2, 3 after warm-up
        r.moved = r.disk_read = r.disk_written = 0  # the last iteration's traffic is kept
        peaks.append(step.run())
        fast = int(step.fast)
    # a shard read from disk lands on the host before it goes to the device (disk.shard_from_disk)
    in_flight = r.plan.shard_bytes if r.disk_homed or (layout.disk and layout.placement == "auto") else 0
    info = {
        "device_steady": max(peaks[1:]),
        "static_need": static_need,
        "host_setup": setup_host,
        "host_warmup": warm_host,
        "host_steady": r.host_peak + r.io + in_flight,
        "io_buffers": r.io,
        "disk_file": _disk_file_bytes(r, homes) if layout.disk else 0,
        "host_allowance": allowance or 0,
        "fast_path": fast,
        # working-chunk traffic of one steady step (the speed model's copy time); the optimizer
        # blocks' own moves on a disk tier are not counted
        "bytes_moved_per_step": r.moved,
        "disk_read_per_step": r.disk_read,
        "disk_written_per_step": r.disk_written,
    }
    return r, info


def gemini_memory(
    trace: ModelTrace, layout: Layout, *, device_memory: int, device_type: str = "cpu"
) -> tuple[TierBytes, dict[str, int]]:
    """Per-rank peak bytes per tier of training ``trace``'s model with ``GeminiDDP`` + ``GeminiOptimizer``
    (``torch.optim.AdamW``-like, ``layout.states`` fp32 states per element) at steady state (step >= 2).

    ``device`` is ``GeminiStats.peak_device_bytes``: accounted model data (gathered chunks, device shards,
    gradient buffers, device optimizer blocks) plus the traced non-model bytes reserved at the same
    operator. Where the budget (``layout.device_budget``, else ``device_memory``) is below what one step
    needs, ``device`` is that need (compare it with the budget). The host tier (pinned when
    ``device_type == "cuda"``, pageable on the CPU) is the accounted ``HostTier.peak_bytes`` since
    construction (``GeminiStats.host_peak_bytes``); ``disk`` is the size of the rank's scratch file.

    The breakdown (bytes unless said otherwise): ``chunk_size`` (elements), ``n_chunks``,
    ``n_trainable_chunks`` (those with gradients: all but the frozen ones), ``chunk_bytes`` (one chunk in
    working precision), ``chunks`` (all chunks' working shards of this rank), ``trainable_chunks`` (the
    trainable chunks' working shards),
    ``optimizer_blocks`` (all fp32 master + gradient + state blocks of this rank), ``optimizer_blocks_device``
    (those the placement puts on the device), ``non_model_peak`` (the largest traced operator),
    ``padding`` (elements), ``budget``, ``min_device`` (:func:`gemini_min_device_bytes`), ``fits`` (1 or 0),
    ``device_steady`` (the replayed step's peak), ``host_setup`` / ``host_warmup`` / ``host_steady`` (the
    host tier's peak while chunks are built, at the end of warm-up, in steady steps), ``io_buffers``,
    ``disk_file``, ``operators`` (Gemini operators per step), ``fast_path`` (1 when steps run resident).
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    budget = layout.device_budget if layout.device_budget is not None else device_memory
    min_need = gemini_min_device_bytes(trace, layout)
    ranks = sorted({0, layout.dp - 1}) if not layout.keep_gathered else [0]
    runs = [_simulate(trace, layout, budget, k) for k in ranks]
    r, info = max(runs, key=lambda ri: (ri[1]["device_steady"], ri[1]["host_steady"]))
    need = max(min_need, r.need)  # min_need holds the static check's
    fits = need <= budget and r.need == 0
    device = info["device_steady"] if fits else max(need, info["device_steady"])
    host = max(max(ri[1]["host_setup"], ri[1]["host_warmup"], ri[1]["host_steady"]) for ri in runs)
    if layout.disk and layout.host_budget is not None:  # the host tier enforces it: shards spill to disk first
        host = min(host, layout.host_budget)
    p = r.plan
    breakdown = {
        "chunk_size": p.size,
        "n_chunks": r.n,
        "n_trainable_chunks": len(r.trainable),
        "chunk_bytes": p.chunk_bytes,
        "chunks": r.n * p.shard_bytes,
        "trainable_chunks": len(r.trainable) * p.shard_bytes,
        "optimizer_blocks": sum(r.blocks),
        "optimizer_blocks_device": sum(r.blocks[c] for c in r.o_dev),
        "non_model_peak": r.peak_nm,
        "padding": r.n * p.size - sum(p.numels),
        "budget": budget,
        "min_device": min_need,
        "fits": int(fits),
        "operators": len(r.ops),
        **info,
    }
    pinned = host if device_type == "cuda" else 0
    tiers = TierBytes(device=device, pinned_host=pinned, host=host - pinned, disk=info["disk_file"])
    return tiers, breakdown
