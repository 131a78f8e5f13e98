"""Chunk manager: packs parameters into chunks and moves chunk buffers between tiers and ranks.

It owns the tiers, the traffic counter and every data movement (fetch, evict, gather, release,
gradient reduction). It decides nothing: *which* chunk to fetch or evict is the placement
policy's choice (:mod:`colossal.gemini.placement`).

[Note: aliased masters]
With fp32 working data, whole chunks on this rank (not sharded) and both the working payload and
the optimizer block on the device tier (no disk tier), the fp32 master would be a copy of the
payload, refreshed by a full copy after every step. Instead ``chunk.master`` *is* ``chunk.payload``
from the first refresh that finds the chunk so (``refresh_working``): the optimizer steps the
working parameters in place, as ``torch.optim`` does on a plain module, and the refresh is a no-op.
The freed master keeps its accounting (the device tier still counts its bytes), so giving the
master its own buffer again can never fail on the budget: ``_drop_payload`` does that before the
payload's storage goes (an eviction), and ``move_optim`` copies the master to its new tier as
before (the payload stays). ``repoint`` (set by ``GeminiOptimizer``) re-points the optimizer's
slice views after ``chunk.master`` changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import colossal.comm as comm
from colossal.comm import pack, search_chunk_size
from colossal.gemini import events
from colossal.gemini.chunk import Chunk, ChunkState, IllegalTransitionError, TensorInfo, TensorState
from colossal.gemini.tiers import BudgetExceededError, DeviceTier, HostTier, Tier, Traffic, count, transfer

__all__ = ["ChunkManager", "search_chunk_size", "pack"]


class ChunkManager:
    """Chunks of one model on one rank, their buffers on the tiers, and the moves between them."""

    def __init__(
        self,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        chunk_size: int | None,
        dtype: torch.dtype,
        device: DeviceTier,
        host: HostTier,
        group: ProcessGroup | None,
        keep_gathered: bool = False,
    ):
        self.device, self.host = device, host
        self.group = group
        self.dp_size = dist.get_world_size(group) if dist.is_initialized() else 1  # data-parallel ranks
        # chunks are split over world_size ranks: the data-parallel size, or 1 when kept gathered (plain DDP)
        self.world_size = 1 if keep_gathered else self.dp_size
        self.rank = dist.get_rank(group) if dist.is_initialized() and self.world_size > 1 else 0  # shard index
        self.dtype = dtype
        self.traffic = Traffic()
        self.grad_buffer_bytes = 0  # device bytes of live gradient buffers
        self.disk = None  # DiskTier when GeminiConfig.disk_dir is set (colossal.gemini.disk)
        self.disk_homed: set[int] = set()  # static: chunks whose working shard lives on disk between uses
        self.host_allowance: int | None = None  # auto: host bytes working shards may hold (the rest spill)
        self.spill_rank = None  # callable(chunk) -> float: host shards spill to disk highest rank first
        self.repoint = None  # callable(chunk): re-point the optimizer's views after chunk.master changed
        numels = [p.numel() for _, p in params]
        size = chunk_size or search_chunk_size(numels, align=self.world_size)
        size = -(-size // self.world_size) * self.world_size
        self.chunk_size = size
        self.chunks: list[Chunk] = []
        self.chunk_of: dict[torch.nn.Parameter, tuple[Chunk, TensorInfo]] = {}
        for idx, frozen in _pack_apart(numels, [p.requires_grad for _, p in params], size):  # [Note: frozen chunks]
            chunk = Chunk(len(self.chunks), size, dtype, device.device, self.world_size, frozen=frozen)
            for i in idx:
                name, p = params[i]
                self.chunk_of[p] = (chunk, chunk.append(p, name))
            self.chunks.append(chunk)
        self.trainable = [c for c in self.chunks if not c.frozen]
        """The chunks with gradients, masters and optimizer states (all but the frozen ones)."""

    def materialise(self, init_fn: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Fill every chunk, one at a time, and leave its shards on the host tier (lazy-init safe)."""
        for chunk in self.chunks:
            self._materialise(chunk, init_fn)

    def tier(self, name: str) -> Tier:
        """The tier called ``name``."""
        if name == "disk":
            return self.disk
        return self.device if name == "device" else self.host

    # -- disk tier (see colossal.gemini.disk) ------------------------------------------------------------
    def host_working_bytes(self) -> int:
        """Host bytes held by working shards."""
        return sum(c.shard_nbytes for c in self.chunks if c.w_tier == "host")

    def host_room(self, nbytes: int, protect: set[int], allow=None) -> bool:
        """Spill host working shards to disk until ``nbytes`` more fit the host budget and allowance;
        ``allow(victim)`` may veto a spill (then False). No-op without a disk tier."""
        if self.disk is None:
            return True
        host = self.host
        while (host.budget is not None and host.used_bytes + nbytes > host.budget) or (
            self.host_allowance is not None and self.host_working_bytes() + nbytes > self.host_allowance
        ):
            cands = [c for c in self.chunks if c.w_tier == "host" and c.id not in protect]
            victim = max(cands, key=lambda c: (self.spill_rank(c), c.id), default=None)
            if victim is None or (allow is not None and not allow(victim)):
                if allow is not None:
                    return False
                raise BudgetExceededError(
                    f"host tier: need {host.used_bytes + nbytes} bytes (working shards "
                    f"{self.host_working_bytes() + nbytes}, allowance {self.host_allowance}), budget "
                    f"{host.budget}; raise host_memory_budget or put more on disk"
                )
            self.to_disk(victim)
        return True

    def to_disk(self, chunk: Chunk) -> None:
        """Move the chunk's working shard from the host tier to its disk region."""
        from colossal.gemini.disk import settle, shard_to_disk

        settle(self, chunk)
        shard_to_disk(self, chunk)

    def from_disk(self, chunk: Chunk) -> None:
        """Bring the chunk's working shard to the host tier if it is on disk (or being prefetched)."""
        from colossal.gemini.disk import settle, shard_from_disk

        if chunk.w_tier == "disk":
            shard_from_disk(self, chunk)
        settle(self, chunk)

    def _evict_to_disk(self, chunk: Chunk) -> bool:
        """Disk tier, on eviction from the device: a disk-homed shard, or one the host has no room for
        without spilling a shard needed sooner, goes straight to disk (True); else room is made (False)."""
        if self.disk is None:
            return False
        if chunk.id not in self.disk_homed:
            rank = self.spill_rank(chunk)
            if self.host_room(chunk.shard_nbytes, {chunk.id}, allow=lambda v: self.spill_rank(v) > rank):
                return False
        from colossal.gemini.disk import evict_to_disk

        evict_to_disk(self, chunk)
        return True

    def _home(self, chunk: Chunk) -> None:
        """After eviction to the host: a static disk-homed shard goes home; otherwise spill if over."""
        if self.disk is None:
            return
        if chunk.id in self.disk_homed:
            self.to_disk(chunk)
        else:
            self.host_room(0, set())

    # -- construction ------------------------------------------------------------------------------
    def _materialise(self, chunk: Chunk, init_fn: Callable[[str, torch.Tensor], None] | None) -> None:
        """Fill the chunk on the device (from the parameters or ``init_fn``), then leave its shard on the host."""
        originals = [info.param.data for info in chunk.tensors]
        self._alloc_payload(chunk)
        chunk.payload.zero_()  # padding is zero
        chunk.bind()
        with torch.no_grad():
            for info, data in zip(chunk.tensors, originals):
                if data.is_meta:
                    if init_fn is None:
                        raise ValueError(f"parameter {info.name!r} is on the meta device: pass param_init_fn")
                    init_fn(info.name, info.param.data)
                else:
                    info.param.data.copy_(data)
        chunk.state = ChunkState.GATHERED
        for info in chunk.tensors:
            info.state = TensorState.HOLD
        lo, hi = chunk.shard_range(self.rank)
        if not chunk.frozen:
            self._materialise_optim(chunk, originals)
        chunk.shard = self.host.alloc(chunk.shard_size, self.dtype, f"chunk {chunk.id} shard")
        chunk.shard.copy_(chunk.payload[lo:hi])
        chunk.w_tier = "host"
        self._drop_payload(chunk)
        if self.disk is not None:
            from colossal.gemini.disk import home

            home(self, chunk)

    def _materialise_optim(self, chunk: Chunk, originals: list[torch.Tensor]) -> None:
        """The fp32 master (from the unrounded originals) and the gradient shard, on the host tier."""
        lo, hi = chunk.shard_range(self.rank)
        chunk.master = self.host.alloc(chunk.shard_size, torch.float32, f"chunk {chunk.id} master")
        chunk.master.copy_(chunk.payload[lo:hi])
        for info, data in zip(chunk.tensors, originals):  # masters from the unrounded originals
            a, b = max(info.offset, lo), min(info.offset + info.numel, hi)
            if a < b and not data.is_meta:
                chunk.master[a - lo : b - lo].copy_(data.reshape(-1)[a - info.offset : b - info.offset])
        chunk.grad_shard = self.host.alloc(chunk.shard_size, torch.float32, f"chunk {chunk.id} grad").zero_()

    def _alloc_payload(self, chunk: Chunk) -> None:
        pooled = self.device.take_buffer(chunk.nbytes)  # [Note: the chunk-buffer pool] in tiers.py
        try:
            self.device.charge(chunk.nbytes, f"chunk {chunk.id}")
        except BaseException:
            if pooled is not None:
                self.device.keep_buffer(pooled)
            raise
        storage = chunk.payload.untyped_storage()
        if pooled is not None:
            storage._swap_data_ptr_(pooled)
        else:
            storage.resize_(chunk.nbytes)

    def _drop_payload(self, chunk: Chunk) -> None:
        chunk.to_released()
        if self.aliased(chunk):  # the master outlives the payload's storage
            self._unalias(chunk)
        self.device.refund(chunk.nbytes)
        storage = chunk.payload.untyped_storage()
        if not self.device.keep_buffer(storage):
            storage.resize_(0)

    @property
    def sharded(self) -> bool:
        """True when chunks are split over several data-parallel ranks."""
        return self.world_size > 1

    @property
    def replicated(self) -> bool:
        """True when whole chunks are kept on several data-parallel ranks (gradients all-reduced)."""
        return self.world_size == 1 and self.dp_size > 1

    # -- working-precision data ------------------------------------------------------------------------
    def device_bytes_to_fetch(self, chunk: Chunk) -> int:
        """Device bytes that fetching ``chunk`` adds (0 when it is already gathered)."""
        if chunk.state is ChunkState.GATHERED:
            return 0
        extra = chunk.shard_nbytes if chunk.w_tier == "host" and self.sharded else 0
        return chunk.nbytes + extra

    def resident_bytes(self, chunk: Chunk) -> int:
        """Device bytes the chunk's working data holds now (shard and gathered payload)."""
        gathered = chunk.nbytes if chunk.state is ChunkState.GATHERED else 0
        if not self.sharded:
            return gathered
        return gathered + (chunk.shard_nbytes if chunk.w_tier == "device" else 0)

    def fetch(self, chunk: Chunk) -> None:
        """Make the whole chunk computable on the device (bring the shard over, then gather)."""
        if chunk.state is ChunkState.GATHERED:
            self.wait_gather(chunk)
            return
        with events.label("fetch"):
            if self.disk is not None:
                self.from_disk(chunk)
            if not self.sharded:
                start = time.perf_counter()
                was = chunk.w_tier
                self._alloc_payload(chunk)
                chunk.payload.copy_(chunk.shard)
                if was == "host":
                    self.host.free(chunk.shard)
                    count(self.traffic, self.host, self.device, chunk.nbytes, chunk.id, "fetch", start)
                chunk.shard, chunk.w_tier = chunk.payload, "device"
            else:
                self._start_gather(chunk, async_op=False)
            chunk.to_gathered()

    def prefetch(self, chunk: Chunk) -> None:
        """Start gathering a sharded chunk asynchronously; :meth:`fetch` (or :meth:`release`) waits for it.

        The chunk counts as GATHERED (its payload is allocated and accounted) from now on, so the
        collective is issued exactly once per chunk on every rank. See ``[Note: prefetch]``.
        """
        if chunk.state is ChunkState.GATHERED:
            return
        with events.label("prefetch"):
            chunk.gather_handle = self._start_gather(chunk, async_op=True)
            chunk.to_gathered()

    def wait_gather(self, chunk: Chunk) -> None:
        """Block until the chunk's asynchronous gather (if any) has filled its payload."""
        if chunk.gather_handle is not None:
            with events.label("wait_prefetch"):
                chunk.gather_handle.wait()
            chunk.gather_handle = None

    def _start_gather(self, chunk: Chunk, async_op: bool):
        if self.disk is not None:
            self.from_disk(chunk)
        if chunk.w_tier == "host":
            chunk.shard = transfer(chunk.shard, self.host, self.device, self.traffic, chunk.id, "fetch")
            chunk.w_tier = "device"
        self._alloc_payload(chunk)
        tag = "gemini.prefetch" if async_op else "gemini.gather"
        return comm.all_gather(chunk.shard, group=self.group, async_op=async_op, tag=tag, out=chunk.payload)

    def release(self, chunk: Chunk) -> None:
        """Drop the gathered payload of a sharded chunk (its shard stays); no-op without sharding."""
        if self.sharded and chunk.state is ChunkState.GATHERED:
            self.wait_gather(chunk)  # the collective still writes into the payload
            self._drop_payload(chunk)

    def evict(self, chunk: Chunk) -> None:
        """Move the chunk's working shard to the host tier (releasing the payload first)."""
        with events.label("evict"):
            if not self.sharded:
                if chunk.state is ChunkState.RELEASED:
                    return
                self._check_idle(chunk, "evict")
                if self._evict_to_disk(chunk):
                    return
                start = time.perf_counter()
                shard = self.host.alloc(chunk.size, self.dtype, f"chunk {chunk.id} shard")
                shard.copy_(chunk.payload)
                self._drop_payload(chunk)
                chunk.shard, chunk.w_tier = shard, "host"
                count(self.traffic, self.device, self.host, chunk.nbytes, chunk.id, "evict", start)
                self._home(chunk)
                return
            self.release(chunk)
            if chunk.w_tier == "device":
                if self._evict_to_disk(chunk):
                    return
                chunk.shard = transfer(chunk.shard, self.device, self.host, self.traffic, chunk.id, "evict")
                chunk.w_tier = "host"
                self._home(chunk)

    def _check_idle(self, chunk: Chunk, what: str) -> None:
        if chunk.in_use:
            busy = [i.name for i in chunk.tensors if i.state in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD)]
            raise IllegalTransitionError(
                f"chunk {chunk.id}: cannot {what} while tensors {busy} are in use (pins {chunk.pins})"
            )

    # -- gradients -------------------------------------------------------------------------------------
    def direct_grad(self, chunk: Chunk) -> bool:
        """Unsharded chunk with its fp32 gradient shard on the device: gradients go straight there (no buffer)."""
        return self.dp_size == 1 and chunk.o_tier == "device"

    def add_grad(self, chunk: Chunk, info: TensorInfo, grad: torch.Tensor) -> None:
        """Put one parameter's gradient into the chunk's gradient buffer (allocated on first use); added to
        what its slot holds when the parameter already got part of its gradient since the last reduction."""
        again = info.grads > 0
        info.grads += 1
        if self.direct_grad(chunk):
            dst = chunk.grad_shard[info.offset : info.offset + info.numel]
            (dst.add_ if chunk.has_grad or again else dst.copy_)(grad.reshape(-1))
            chunk.written.add(info.offset)
            return
        if chunk.grad_buffer is None:
            self._alloc_grad_buffer(chunk)
        dst = chunk.grad_buffer[info.offset : info.offset + info.numel]
        (dst.add_ if again else dst.copy_)(grad.reshape(-1))

    def _alloc_grad_buffer(self, chunk: Chunk) -> None:
        self.device.charge(chunk.nbytes, f"chunk {chunk.id} gradient buffer")
        chunk.grad_buffer = torch.zeros(chunk.size, dtype=self.dtype, device=self.device.device)
        self.grad_buffer_bytes += chunk.nbytes

    def reduce(self, chunk: Chunk) -> None:
        """Start reducing the chunk's gradient buffer: reduce-scatter when sharded, all-reduce when replicated."""
        if self.direct_grad(chunk):
            chunk.pending = None
            return
        if chunk.grad_buffer is None:  # every tensor unused on this rank: contribute zeros
            self._alloc_grad_buffer(chunk)
        with events.label("reduce"):
            if self.sharded:
                chunk.pending = comm.reduce_scatter(  # the buffer is dropped after: gloo may reduce in place
                    chunk.grad_buffer, "sum", self.group, async_op=True, tag="gemini.reduce_scatter", destroy_input=True
                )
            elif self.replicated:
                chunk.pending = comm.all_reduce(
                    chunk.grad_buffer, "sum", self.group, async_op=True, tag="gemini.all_reduce"
                )
            else:
                chunk.pending = None

    def finish_reduce(self, chunk: Chunk) -> None:
        """Wait for the reduction, add the averaged gradient shard into ``grad_shard`` on its tier."""
        if self.direct_grad(chunk):
            if not chunk.has_grad:  # slots no gradient was written to (unused parameters, padding) are zero
                for info in chunk.tensors:
                    if info.offset not in chunk.written:
                        chunk.grad_shard[info.offset : info.offset + info.numel].zero_()
                chunk.grad_shard[chunk.used :].zero_()
            chunk.written.clear()
            chunk.has_grad = True
            chunk.after_reduce()
            return
        grad = chunk.pending.wait() if chunk.pending is not None else chunk.grad_buffer
        chunk.pending = None
        if self.dp_size > 1:
            grad.div_(self.dp_size)
        accumulate = chunk.grad_shard.add_ if chunk.has_grad else chunk.grad_shard.copy_  # no zeroing pass
        if chunk.o_tier == "device":
            accumulate(grad)
        else:
            start = time.perf_counter()
            host_grad = grad.to("cpu", non_blocking=False)
            count(
                self.traffic,
                self.device,
                self.host,
                grad.numel() * grad.element_size(),
                chunk.id,
                "grad_offload",
                start,
            )
            if "grad" in chunk.on_disk:
                from colossal.gemini.disk import grad_to_disk

                grad_to_disk(self, chunk, host_grad)
            else:
                accumulate(host_grad)
        chunk.has_grad = True
        chunk.grad_buffer = None
        self.device.refund(chunk.nbytes)
        self.grad_buffer_bytes -= chunk.nbytes
        chunk.after_reduce()

    # -- master weights --------------------------------------------------------------------------------
    def can_alias(self, chunk: Chunk) -> bool:
        """Whether the chunk's fp32 master can be its working payload itself (see ``[Note: aliased
        masters]``): fp32 working data, whole chunks on this rank, both on the device tier, no disk tier."""
        return (
            not chunk.frozen
            and self.disk is None
            and self.dtype == torch.float32
            and not self.sharded
            and chunk.state is ChunkState.GATHERED
            and chunk.w_tier == "device"
            and chunk.o_tier == "device"
        )

    @staticmethod
    def aliased(chunk: Chunk) -> bool:
        """True while the chunk's master *is* its payload (the optimizer steps the working data in place)."""
        return chunk.master is chunk.payload

    def _alias(self, chunk: Chunk) -> None:
        """Make the payload the master (equal in fp32 after a refresh); the old master's memory is freed,
        its accounting kept (breaking the alias needs the bytes back: it can never fail on the budget)."""
        chunk.master = chunk.payload
        if self.repoint is not None:
            self.repoint(chunk)

    def _unalias(self, chunk: Chunk) -> None:
        """Give the master its own buffer again (before the payload is dropped)."""
        chunk.master = chunk.payload.detach().clone()
        if self.repoint is not None:
            self.repoint(chunk)

    def refresh_working(self, chunk: Chunk) -> None:
        """Copy the updated fp32 master shard into the working-precision data (after a step); a master that
        is the working data (``[Note: aliased masters]``) needs no copy, and one that can become it does."""
        if chunk.frozen or self.aliased(chunk):
            return
        if self.disk is not None:
            from colossal.gemini.disk import refresh_from

            refresh_from(self, chunk, chunk.master)
            return
        lo, hi = chunk.shard_range(self.rank)
        target = chunk.shard if self.sharded or chunk.w_tier == "host" else chunk.payload[lo:hi]
        start = time.perf_counter()
        target.copy_(chunk.master)
        if chunk.o_tier != chunk.w_tier:
            src, dst = self.tier(chunk.o_tier), self.tier(chunk.w_tier)
            count(self.traffic, src, dst, target.numel() * target.element_size(), chunk.id, "param_refresh", start)
        if self.sharded:
            self.release(chunk)  # a stale gathered payload must not survive the update
        elif self.can_alias(chunk):
            self._alias(chunk)

    def read_working(self, chunk: Chunk) -> torch.Tensor:
        """A ``(shard_size,)`` fp32 CPU copy of this rank's working shard, wherever it is (device, host or
        disk): a frozen chunk's values, which it holds nowhere else ([Note: frozen chunks])."""
        if self.disk is not None:
            from colossal.gemini.disk import settle

            settle(self, chunk)
            if chunk.w_tier == "disk":
                self.disk.drain()
                buf = torch.empty(chunk.shard_size, dtype=self.dtype)
                self.disk.read_tensor(buf, chunk.id, "shard", "checkpoint")
                return buf.float()
        lo, hi = chunk.shard_range(self.rank)
        src = chunk.shard if self.sharded or chunk.w_tier == "host" else chunk.payload[lo:hi]
        return src.detach().to("cpu", torch.float32)

    def write_working(self, chunk: Chunk, values: torch.Tensor) -> None:
        """Set this rank's working shard of a frozen chunk to ``values`` (``(shard_size,)``), wherever it
        is; a gathered payload of a sharded chunk is released (it is stale)."""
        if not chunk.frozen:
            raise ValueError(f"chunk {chunk.id} has an fp32 master: write the master and refresh_working")
        if self.disk is not None:
            from colossal.gemini.disk import refresh_from

            refresh_from(self, chunk, values)
            return
        lo, hi = chunk.shard_range(self.rank)
        target = chunk.shard if self.sharded or chunk.w_tier == "host" else chunk.payload[lo:hi]
        target.copy_(values)
        if self.sharded:
            self.release(chunk)

    def move_optim(self, chunk: Chunk, dst: str) -> None:
        """Move the chunk's master and gradient shards to tier ``dst`` (optimizer states: the optimizer)."""
        if chunk.o_tier == dst or chunk.frozen:
            return
        src_tier, dst_tier = self.tier(chunk.o_tier), self.tier(dst)
        chunk.master = transfer(chunk.master, src_tier, dst_tier, self.traffic, chunk.id, "placement")
        chunk.grad_shard = transfer(chunk.grad_shard, src_tier, dst_tier, self.traffic, chunk.id, "placement")
        chunk.o_tier = dst

    def chunks_on(self, tier: str) -> int:
        """Number of chunks whose working shard is on ``tier``."""
        return sum(c.w_tier == tier for c in self.chunks)


def _pack_apart(numels: list[int], grads: list[bool], size: int) -> list[tuple[list[int], bool]]:
    """``pack`` the trainable and the frozen parameters (first-use order) apart, so no chunk mixes
    them, each stream filling its chunks across the model (a LoRA model alternates a frozen base
    weight with two small adapters: packed run by run, every adapter pair would take a chunk of its
    own); the chunks as ``(indices, frozen)`` in the order of their first parameter's first use."""
    out = []
    for frozen in (False, True):
        ids = [i for i, g in enumerate(grads) if g != frozen]
        out += [([ids[j] for j in idx], frozen) for idx in pack([numels[i] for i in ids], size)]
    return sorted(out, key=lambda c: c[0][0])
