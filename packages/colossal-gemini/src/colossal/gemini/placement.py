"""Placement policies: which chunks live on the device tier, and the offline optimum to judge them.

* :class:`WarmupPolicy` - before a trace exists: fetch on demand, evict the least recently used.
* :class:`StaticPolicy` - fixed fractions of working chunks and optimizer blocks on the host
  (ZeRO-Offload-like); host-homed chunks are fetched for each use and evicted after it.
* :class:`AutoPolicy` - before each operator, room = budget - traced non-model data of that
  operator; missing chunks are fetched, evicting the chunk whose next use is furthest in the future
  (Belady, with the traced sequence as the future). Optimizer blocks (fp32 master, fp32 gradient,
  optimizer states) go to the device as far as the margin left by the peak operator allows.
* :func:`belady` - the offline optimum on a trace, a pure function.

[Note: why Belady is optimal here]
All chunks have the same size (the last one is padded), so keeping chunks on the device is paging
with unit-size pages and a capacity that changes per operator (budget minus that operator's
non-model data). Evicting the page whose next use is furthest minimises the number of fetches
for such a sequence (the classic exchange argument holds step by step); every fetched chunk is
evicted once later in a steady state, so bytes moved are minimised too.
``test_gemini_belady.py`` checks it against brute force on random traces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from colossal.gemini.chunk import Chunk
from colossal.gemini.tiers import BudgetExceededError
from colossal.gemini.tracer import Trace

__all__ = [
    "BeladyResult",
    "belady",
    "TwoLevelResult",
    "belady_two_level",
    "PlacementPolicy",
    "WarmupPolicy",
    "StaticPolicy",
    "AutoPolicy",
]


@dataclasses.dataclass(frozen=True, slots=True)
class BeladyResult:
    """Fetches and evictions of the offline-optimal schedule (counted over the last cycle)."""

    loads: int
    """Chunks fetched to the device."""
    evictions: int
    """Chunks evicted from the device."""
    resident: frozenset[int]
    """Chunks on the device at the end."""


def _next_use(uses: dict[int, list[int]], c: int, i: int, n: int, cyclic: bool) -> float:
    for p in uses.get(c, ()):
        if p > i:
            return p
    if cyclic and uses.get(c):
        return uses[c][0] + n
    return math.inf


def belady(
    accesses: Sequence[frozenset[int]],
    capacity: Sequence[int],
    resident: frozenset[int] = frozenset(),
    cycles: int = 1,
) -> BeladyResult:
    """Offline-optimal paging of unit-size chunks: ``accesses[i]`` must be resident at step ``i``, holding
    at most ``capacity[i]`` chunks. With ``cycles > 1`` the sequence repeats (a training loop) and the
    counts are those of the last repetition, i.e. the steady state."""
    if len(accesses) != len(capacity):
        raise ValueError(f"accesses and capacity must have equal length, got {len(accesses)} and {len(capacity)}")
    uses: dict[int, list[int]] = {}
    for i, need in enumerate(accesses):
        for c in need:
            uses.setdefault(c, []).append(i)
    held, n = set(resident), len(accesses)
    for _ in range(cycles):
        loads = evictions = 0
        for i, need in enumerate(accesses):
            if len(need) > capacity[i]:
                raise ValueError(f"step {i} needs {len(need)} chunks but capacity is {capacity[i]}")
            while len(held | need) > capacity[i]:
                victim = max(held - need, key=lambda c: (_next_use(uses, c, i, n, cycles > 1), c))
                held.discard(victim)
                evictions += 1
            loads += len(need - held)
            held |= need
    return BeladyResult(loads=loads, evictions=evictions, resident=frozenset(held))


@dataclasses.dataclass(frozen=True, slots=True)
class TwoLevelResult:
    """Offline optimum of the two-level hierarchy device <- host <- disk (counted over the last cycle)."""

    device_loads: int
    """Chunks fetched to the device (Belady at the device capacity)."""
    device_evictions: int
    """Chunks evicted from the device."""
    disk_reads: int
    """Chunks read from disk (Belady at device + host capacity)."""


def belady_two_level(
    accesses: Sequence[frozenset[int]], device_capacity: Sequence[int], host_capacity: int, cycles: int = 1
) -> TwoLevelResult:
    """Offline optimum of unit-size chunks over device <- host <- disk (exclusive tiers, the disk holds
    every chunk and a clean copy of each, so only reads cost disk traffic).

    Disk reads: a chunk is read when it enters device-or-host, whose combined capacity at step ``i`` is
    ``device_capacity[i] + host_capacity``; any split of that set between device and host is reachable
    by host<->device moves, which cost no disk traffic, so the minimum is Belady at the combined
    capacity. Device loads: Belady at the device capacity. Each is the minimum of its own level; a
    policy's traffic is at least each (``test_gemini_disk_belady.py`` checks both against a brute force
    over the two-level states)."""
    if host_capacity < 0:
        raise ValueError(f"host_capacity must be >= 0, got {host_capacity}")
    dev = belady(accesses, device_capacity, frozenset(), cycles)
    both = belady(accesses, [c + host_capacity for c in device_capacity], frozenset(), cycles)
    return TwoLevelResult(device_loads=dev.loads, device_evictions=dev.evictions, disk_reads=both.loads)


class PlacementPolicy:
    """Decides fetches and evictions of working chunks on the device tier of one :class:`ChunkManager`."""

    name = "base"

    def __init__(self, manager, non_model: callable):
        self.m = manager
        self._non_model = non_model  # op index -> non-model bytes to keep room for
        self.last_use: dict[int, int] = {}
        self.protected: frozenset[int] = frozenset()  # gathered or in flight for the prefetch window: never evicted
        # how budget errors name operator i and what they suggest (GeminiDDP sets both: module labels, and
        # only the settings that help in its configuration)
        self.where: callable = lambda i: f"operator {i}"
        self.advice: callable = lambda: "raise device_memory_budget or lower chunk_size"

    def victim(self, protect: set[int], i: int) -> Chunk | None:
        """The chunk to evict before operator ``i`` (None when nothing may go)."""
        raise NotImplementedError

    def spill_rank(self, chunk: Chunk, i: int) -> float:
        """Disk tier: host working shards spill to disk highest rank first (here: least recently used;
        the auto policy ranks by traced next use)."""
        return -self.last_use.get(chunk.id, -1)

    def fixed_bytes(self, exclude: set[int]) -> int:
        """Device bytes of working data this policy never evicts, over the chunks outside ``exclude``
        (a prefetch plan must fit next to them)."""
        return 0

    def _evictable(self, protect: set[int]) -> list[Chunk]:
        return [
            c
            for c in self.m.chunks
            if self.m.resident_bytes(c) and c.id not in protect and c.id not in self.protected and not c.in_use
        ]

    def make_room(self, nbytes: int, protect: set[int], i: int) -> None:
        """Evict until ``nbytes`` more model bytes fit next to operator ``i``'s non-model data."""
        dev = self.m.device
        dev.set_reserve(self._non_model(i))  # the chunk-buffer pool fits next to it (tiers.py)
        while dev.used_bytes + nbytes + self._non_model(i) > dev.budget:
            victim = self.victim(protect, i)
            if victim is None:
                need = dev.used_bytes + nbytes + self._non_model(i)
                raise BudgetExceededError(
                    f"need {need} bytes on the device (model {dev.used_bytes + nbytes}, non-model "
                    f"{self._non_model(i)}) at {self.where(i)}, budget {dev.budget}; {self.advice()}"
                )
            self.m.evict(victim)

    def before_op(self, i: int, needed: Sequence[Chunk]) -> None:
        """Make the chunks of operator ``i`` computable on the device."""
        protect = {c.id for c in needed}
        self.make_room(sum(self.m.device_bytes_to_fetch(c) for c in needed), protect, i)
        for c in needed:
            self.m.fetch(c)
            self.last_use[c.id] = i

    def after_op(self, used: Sequence[Chunk], coming: set[int]) -> None:
        """Operator done: sharded chunks drop their gathered payload unless the next operator needs them."""
        for c in used:
            if c.id not in coming and not c.in_use:
                self.m.release(c)


class WarmupPolicy(PlacementPolicy):
    """No trace yet: fetch on demand and evict after use, so the device holds the least model data while
    the tracer measures non-model data (LRU eviction if even that needs room)."""

    name = "warmup"

    def after_op(self, used: Sequence[Chunk], coming: set[int]) -> None:
        super().after_op(used, coming)
        for c in used:
            if c.id not in coming and not c.in_use:
                self.m.evict(c)

    def victim(self, protect: set[int], i: int) -> Chunk | None:
        cands = self._evictable(protect)
        return min(cands, key=lambda c: self.last_use.get(c.id, -1), default=None)


class StaticPolicy(PlacementPolicy):
    """Fixed homes: the last ``offload_param_frac`` of chunks live on the host and visit the device per use."""

    name = "static"

    def __init__(self, manager, non_model, offload_param_frac: float):
        super().__init__(manager, non_model)
        n = len(manager.chunks)
        self.host_homed = {c.id for c in manager.chunks[n - round(offload_param_frac * n) :]}

    def victim(self, protect: set[int], i: int) -> Chunk | None:
        cands = [c for c in self._evictable(protect) if c.id in self.host_homed]
        return min(cands, key=lambda c: self.last_use.get(c.id, -1), default=None)

    def fixed_bytes(self, exclude: set[int]) -> int:
        """Device-homed chunks stay on the device once fetched: their working shards (whole chunks
        without sharding) are never evicted."""
        m = self.m
        return sum(c.shard_nbytes if m.sharded else c.nbytes for c in m.chunks if c.id not in self.host_homed | exclude)

    def after_op(self, used: Sequence[Chunk], coming: set[int]) -> None:
        super().after_op(used, coming)
        for c in used:
            if c.id in self.host_homed and c.id not in coming and not c.in_use:
                self.m.evict(c)


class AutoPolicy(PlacementPolicy):
    """Belady eviction driven by the traced operator sequence."""

    name = "auto"

    def __init__(self, manager, non_model, trace: Trace, disk_prefetch: int = 0):
        super().__init__(manager, non_model)
        self.uses = trace.next_uses()
        self.n = len(trace)
        self.op_chunks = [op.chunk_ids for op in trace.ops]
        self.disk_prefetch = disk_prefetch

    def spill_rank(self, chunk: Chunk, i: int) -> float:
        """Second level of the traced-order eviction: the host shard whose next use is furthest spills."""
        return _next_use(self.uses, chunk.id, i, self.n, True)

    def before_op(self, i: int, needed: Sequence[Chunk]) -> None:
        """Fetch as the base policy, then start reading the next disk-resident chunks of the trace."""
        super().before_op(i, needed)
        if self.m.disk is not None and self.disk_prefetch and 0 <= i < self.n:
            self._disk_ahead(i, {c.id for c in needed})

    def _disk_ahead(self, i: int, protect: set[int]) -> None:
        """Read ahead, in traced order, the next ``disk_prefetch`` distinct chunks; a read may spill only
        host shards used later than the chunk read (Belady at the second level)."""
        from colossal.gemini.disk import prefetch_shard

        seen: set[int] = set()
        for j in range(i + 1, i + self.n):
            for cid in self.op_chunks[j % self.n]:
                if cid in seen or cid in protect:
                    continue
                seen.add(cid)
                c = self.m.chunks[cid]
                if c.w_tier == "disk":
                    nu = _next_use(self.uses, cid, i, self.n, True)
                    allow = lambda v, nu=nu: self.spill_rank(v, i) > nu  # noqa: E731
                    if not prefetch_shard(self.m, c, allow):
                        return
                if len(seen) >= self.disk_prefetch:
                    return

    def victim(self, protect: set[int], i: int) -> Chunk | None:
        cands = self._evictable(protect)
        return max(cands, key=lambda c: (_next_use(self.uses, c.id, i, self.n, True), c.id), default=None)
