"""The disk tier: chunk shards, fp32 masters, gradients and optimizer states in a scratch file per rank.

:class:`DiskTier` is a :class:`~colossal.gemini.tiers.Tier` whose memory is one preallocated file per
rank under ``GeminiConfig.disk_dir``. Each chunk gets fixed regions in it (4 KiB aligned): its working
shard, its fp32 master, its fp32 gradient and one region per optimizer state (``exp_avg``,
``exp_avg_sq``, ...). A tensor living on disk keeps its Python object (the optimizer's state dict,
the parameters' views and the checkpoint code see the same objects) but holds no memory: its storage
is resized to 0 bytes (:func:`hollow`), and reading it is an error, never a silent zero.

[Note: scratch, not checkpoint]
The file is created with a fresh run id (``O_EXCL``), preallocated, and *unlinked at once*: only the
open descriptors keep it alive, so a run that dies (crash, ``kill -9``, node loss) leaves nothing on
the disk, and no later run can find, let alone trust, a previous run's states. Checkpoints go through
:mod:`colossal.gemini.checkpoint` (DCP) as before: the functions there page the disk-resident tensors
in for the duration of the call (they need host memory for them; a streaming save is not done).

[Note: I/O]
Reads and writes run on a small pool of threads (``disk_io_threads``; ``os.preadv``/``os.pwritev``
release the GIL) into reusable host buffers (pinned when the compute device is CUDA). When the
filesystem accepts ``O_DIRECT`` (probed at setup with an aligned 4 KiB write and read) the buffers are
4 KiB aligned and the I/O bypasses the page cache; otherwise plain ``pread``/``pwrite`` followed by
``posix_fadvise(POSIX_FADV_DONTNEED)``, so the page cache does not quietly hold what is claimed to be
on disk (best effort for dirty pages: the kernel drops them once written back). Every read and write
is counted (``bytes_read``, ``bytes_written``) and published as a
:class:`~colossal.gemini.events.ChunkMoveEvent` (``src``/``dst`` ``"disk"``); the time the training
thread waits for I/O is counted in ``wait_seconds`` and published as a ``ChunkMoveEvent`` with
``nbytes=0`` and ``reason="io_wait"`` (the profiler draws both on its chunk-move track).

[Note: streaming optimizer step]
Chunks whose master, gradient or states are on disk are stepped one block (chunk shard) at a time
through three rotating buffer sets: while block ``i`` is stepped (the wrapped optimizer, e.g. the CPU
Adam kernel, runs on views of the buffers: no copy), block ``i+1`` is read and block ``i-1`` written by
the I/O threads. Before block ``i+1`` is read into a set, the write of block ``i-2`` from that set has
finished. The working weights are refreshed from the master while it is in the buffer; with fp32
working data and both on disk the working shard *is* the master region (no extra write).

[Note: gradients with a disk tier]
Where a chunk's gradient lives is independent of its master and states (the static fractions are per
kind): in memory (``grad_shard``) or in its disk region (``grad_shard`` is then a placeholder, and the
I/O threads may still be writing the backward's block). Every reader of the gradients between backward
and step (the overflow check, the clipping norm, ``GeminiOptimizer.grad_norm``) takes the same two
parts: the shards in memory (:func:`memory_grads`, once the writes have drained), a streamed chunk's
included, and per-chunk ``amax`` and norms of the blocks on disk, read in one streamed pass
(:func:`disk_grads_stats`): the p-norm of the per-chunk norms is the norm of the whole. The step
unscales and clips the shards in memory in place and those on disk in their buffers (``grad_scale``
of :func:`stream_step`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import threading
import time
import uuid

import torch

import colossal.comm as comm
from colossal.gemini import events
from colossal.gemini.tiers import Tier, count

__all__ = ["DiskTier", "hollow", "is_hollow", "check_directory", "plan_bytes", "paged_in"]

_ALIGN = 4096
_MAX_IO = 1 << 30  # bytes per system call (Linux caps one read/write at 2 GiB - 4 KiB)
_MAX_PENDING = 2  # asynchronous writes in flight (each holds its source tensor alive)


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def hollow(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``(numel,)`` tensor without memory (storage of 0 bytes): the placeholder of data on disk."""
    t = torch.empty(numel, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


def is_hollow(t: torch.Tensor) -> bool:
    """True for a placeholder of data on disk."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def check_directory(directory, need: int) -> str:
    """``directory`` as a string; ValueError when it does not exist or lacks ``need`` free bytes."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"disk_dir must be a path, got {type(directory).__name__}")
    d = os.fspath(directory)
    if not os.path.isdir(d):
        raise ValueError(f"disk_dir {d!r} does not exist or is not a directory")
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ValueError(f"need {need} bytes on {d}, free {free} (disk tier plan; lower the disk fractions)")
    return d


def plan_bytes(shard_elems: list[int], itemsize: int, homes: dict[str, set[int]], states: int = 2) -> int:
    """File bytes of a plan: ``homes[kind]`` are the chunk indices whose ``kind`` (``shard``, ``master``,
    ``grad``, ``states``) lives on disk; ``states`` fp32 states per element (Adam: 2)."""
    total = 0
    for i, n in enumerate(shard_elems):
        alias = itemsize == 4 and i in homes["shard"] and i in homes["master"]
        total += _round(n * itemsize) * (i in homes["shard"] and not alias)
        total += _round(n * 4) * ((i in homes["master"]) + (i in homes["grad"]) + states * (i in homes["states"]))
    return total


class _Buffers:
    """Reusable aligned host buffers keyed by byte size (charged to the host tier once, when created)."""

    def __init__(self, host: Tier, pin: bool):
        self.host, self.pin = host, pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.created = 0

    def get(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 buffer of at least ``nbytes`` (rounded to 4 KiB)."""
        size = _round(nbytes)
        pool = self.free.get(size)
        if pool:
            return pool.pop()
        self.host.charge(size + _ALIGN, "disk I/O buffer")
        self.created += size + _ALIGN
        raw = torch.empty(size + _ALIGN, dtype=torch.uint8, pin_memory=self.pin)
        skip = (-raw.data_ptr()) % _ALIGN
        return raw[skip : skip + size]

    def put(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse."""
        self.free.setdefault(buf.numel(), []).append(buf)


class DiskTier(Tier):
    """Scratch file of one rank (see the module notes); regions per chunk, I/O threads, counters."""

    name = "disk"

    def __init__(self, directory, need: int, rank: int, host: Tier, *, threads: int = 2, pin: bool = False):
        super().__init__("cpu", None)
        self.directory = check_directory(directory, need)
        self.host = host
        self.run_id = uuid.uuid4().hex[:12]
        self.path = os.path.join(self.directory, f"colossal-gemini-{self.run_id}-rank{rank}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.dfd = None
        try:
            self.direct = self._probe_direct()
            os.unlink(self.path)  # scratch: see [Note: scratch, not checkpoint]
            if need:
                try:
                    os.posix_fallocate(self.fd, 0, need)
                except OSError as e:
                    raise ValueError(f"need {need} bytes on {self.directory}, fallocate failed: {e}") from e
        except BaseException:
            self.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self.size = need
        self.end = 0  # bump allocator over the file
        self.free_regions: dict[int, list[int]] = {}
        self.regions: dict[tuple[int, str], tuple[int, int]] = {}  # (chunk id, kind) -> (offset, bytes)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="gemini-disk")
        self.buffers = _Buffers(host, pin)
        self.pending: list[concurrent.futures.Future] = []  # writes the next read of a region must wait for
        self.bytes_read = self.bytes_written = 0
        self.lock = threading.Lock()
        self.wait_seconds = 0.0
        self.io_seconds = 0.0

    @property
    def kind(self) -> str:
        """``"disk"``."""
        return "disk"

    # -- setup -------------------------------------------------------------------------------------
    def _probe_direct(self) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR | flag)
        except OSError:
            return False
        raw = torch.zeros(2 * _ALIGN, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % _ALIGN
        buf = raw[skip : skip + _ALIGN]
        try:
            _io(os.pwritev, fd, buf.data_ptr(), _ALIGN, 0)
            _io(os.preadv, fd, buf.data_ptr(), _ALIGN, 0)
        except OSError:
            os.close(fd)
            return False
        self.dfd = fd
        return True

    def close(self) -> None:
        """Wait for outstanding I/O and close the file (its blocks are freed: it is already unlinked)."""
        if getattr(self, "pool", None) is not None:
            self.drain()
            self.pool.shutdown(wait=True)
            self.pool = None
        for name in ("dfd", "fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- regions -----------------------------------------------------------------------------------
    def region(self, chunk_id: int, kind: str, nbytes: int) -> int:
        """Offset of the ``kind`` region of chunk ``chunk_id`` (allocated on first use, 4 KiB aligned)."""
        key = (chunk_id, kind)
        if key in self.regions:
            return self.regions[key][0]
        size = _round(nbytes)
        pool = self.free_regions.get(size)
        off = pool.pop() if pool else None
        if off is None:
            off, self.end = self.end, self.end + size
            if self.end > self.size:  # past the preallocated plan (an optimizer with more states)
                try:
                    os.posix_fallocate(self.fd, off, size)
                except OSError as e:
                    raise ValueError(f"need {self.end} bytes on {self.directory}, fallocate failed: {e}") from e
                self.size = self.end
        self.regions[key] = (off, size)
        self.charge(size, f"chunk {chunk_id} {kind}")
        return off

    def has(self, chunk_id: int, kind: str) -> bool:
        """Whether chunk ``chunk_id`` has a ``kind`` region."""
        return (chunk_id, kind) in self.regions

    def alias(self, chunk_id: int, kind: str, other: str) -> None:
        """Make ``kind`` share the ``other`` region of the chunk (fp32 working shard = master)."""
        self.regions[(chunk_id, kind)] = self.regions[(chunk_id, other)] + ("alias",)

    # -- raw I/O (any thread) ------------------------------------------------------------------------
    def _fd_for(self, buf: torch.Tensor, nbytes: int) -> int:
        if self.direct and buf.data_ptr() % _ALIGN == 0 and nbytes % _ALIGN == 0:
            return self.dfd
        return self.fd

    def read_raw(self, buf: torch.Tensor, off: int, nbytes: int, chunk_id: int = -1, why: str = "disk_read") -> None:
        """Read ``nbytes`` at ``off`` into the contiguous CPU tensor ``buf`` (blocking; counted)."""
        start = time.perf_counter()
        fd = self._fd_for(buf, nbytes)
        _io(os.preadv, fd, buf.data_ptr(), nbytes, off)
        if fd == self.fd:
            os.posix_fadvise(self.fd, off, nbytes, os.POSIX_FADV_DONTNEED)
        self._done(nbytes, True, chunk_id, why, start)

    def write_raw(self, buf: torch.Tensor, off: int, nbytes: int, chunk_id: int = -1, why: str = "disk_write") -> None:
        """Write ``nbytes`` of the contiguous CPU tensor ``buf`` at ``off`` (blocking; counted)."""
        start = time.perf_counter()
        fd = self._fd_for(buf, nbytes)
        _io(os.pwritev, fd, buf.data_ptr(), nbytes, off)
        if fd == self.fd:
            os.posix_fadvise(self.fd, off, nbytes, os.POSIX_FADV_DONTNEED)
        self._done(nbytes, False, chunk_id, why, start)

    def _done(self, nbytes: int, read: bool, chunk_id: int, why: str, start: float) -> None:
        end = time.perf_counter()
        with self.lock:  # I/O threads and the training thread count concurrently
            if read:
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
            self.io_seconds += end - start
        if events.has_observers():
            src, dst = ("disk", "cpu") if read else ("cpu", "disk")
            events.emit(events.ChunkMoveEvent(chunk_id, nbytes, src, dst, start, end, why))

    # -- tensor I/O ----------------------------------------------------------------------------------
    def read_tensor(self, t: torch.Tensor, chunk_id: int, kind: str, why: str = "disk_read") -> None:
        """Fill the contiguous tensor ``t`` from the chunk's ``kind`` region (through an aligned buffer
        when ``t`` itself is not aligned for direct I/O)."""
        off = self.regions[(chunk_id, kind)][0]
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu" and (not self.direct or (t.data_ptr() % _ALIGN == 0 and nbytes % _ALIGN == 0)):
            self.read_raw(t, off, nbytes, chunk_id, why)
            return
        with self.staged(chunk_id, kind, nbytes, why) as buf:
            t.view(-1).copy_(buf.view(t.dtype))

    @contextlib.contextmanager
    def staged(self, chunk_id: int, kind: str, nbytes: int, why: str = "disk_read"):
        """The first ``nbytes`` of the chunk's ``kind`` region, read into a reusable aligned I/O buffer
        (a uint8 view, valid inside the block): no allocation per read."""
        buf = self.buffers.get(nbytes)
        try:
            self.read_raw(buf, self.regions[(chunk_id, kind)][0], buf.numel(), chunk_id, why)
            yield buf[:nbytes]
        finally:
            self.buffers.put(buf)

    def write_tensor(self, t: torch.Tensor, chunk_id: int, kind: str, why: str = "disk_write") -> None:
        """Write the tensor ``t`` into the chunk's ``kind`` region (allocated on first use)."""
        nbytes = t.numel() * t.element_size()
        off = self.region(chunk_id, kind, nbytes)
        if t.device.type == "cpu" and t.is_contiguous() and (not self.direct or t.data_ptr() % _ALIGN == 0):
            if not self.direct or nbytes % _ALIGN == 0:
                self.write_raw(t, off, nbytes, chunk_id, why)
                return
        buf = self.buffers.get(nbytes)
        try:
            buf[:nbytes].view(t.dtype).copy_(t.reshape(-1))
            self.write_raw(buf, off, buf.numel() if self.direct else nbytes, chunk_id, why)
        finally:
            self.buffers.put(buf)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on an I/O thread."""
        return self.pool.submit(fn, *args)

    def wait(self, fut: concurrent.futures.Future | None, chunk_id: int = -1):
        """Block until ``fut`` is done (time counted as I/O wait); re-raises its error."""
        if fut is None:
            return None
        if fut.done():
            return fut.result()
        start = time.perf_counter()
        out = fut.result()
        end = time.perf_counter()
        self.wait_seconds += end - start
        if events.has_observers():
            events.emit(events.ChunkMoveEvent(chunk_id, 0, "disk", "cpu", start, end, "io_wait"))
        return out

    def drain(self) -> None:
        """Wait for every write submitted with :meth:`write_async`."""
        left, self.pending = self.pending, []
        for f in left:
            self.wait(f)

    def write_async(self, t: torch.Tensor, chunk_id: int, kind: str, why: str = "disk_write") -> None:
        """Write ``t`` on an I/O thread (the caller must not change ``t`` before :meth:`drain`)."""
        self.region(chunk_id, kind, t.numel() * t.element_size())
        while len(self.pending) >= _MAX_PENDING:  # bound the host memory held by writes in flight
            self.wait(self.pending.pop(0), chunk_id)
        self.pending.append(self.pool.submit(self.write_tensor, t, chunk_id, kind, why))

    def counters(self) -> tuple[int, int, float]:
        """``(bytes read, bytes written, seconds waited)`` so far."""
        return self.bytes_read, self.bytes_written, self.wait_seconds


def _io(fn, fd: int, addr: int, nbytes: int, off: int) -> None:
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _MAX_IO)
        view = (ctypes.c_char * n).from_address(addr + done)
        k = fn(fd, [view], off + done)
        if k <= 0:
            raise OSError(f"disk tier: {fn.__name__} returned {k} at offset {off + done} ({nbytes - done} bytes left)")
        done += k


# -- working shards ---------------------------------------------------------------------------------------
def shard_to_disk(m, chunk, why: str = "evict") -> None:
    """Move the chunk's host-resident working shard to its disk region (no write when the disk copy is
    current: the working data only changes in the optimizer step)."""
    disk = m.disk
    start = time.perf_counter()
    if not chunk.disk_clean:
        disk.write_tensor(chunk.shard, chunk.id, "shard", why)
        chunk.disk_clean = True
    m.host.free(chunk.shard)
    chunk.shard, chunk.w_tier = hollow(chunk.shard_size, m.dtype), "disk"
    count(m.traffic, m.host, disk, 0, chunk.id, why, start)


def evict_to_disk(m, chunk) -> None:
    """Evict the chunk's device-resident working data straight to its disk region (no host copy)."""
    disk = m.disk
    start = time.perf_counter()
    data = chunk.payload if not m.sharded else chunk.shard
    if not chunk.disk_clean:
        disk.write_tensor(data, chunk.id, "shard", "evict")
        chunk.disk_clean = True
    if m.sharded:
        m.device.free(chunk.shard)
    else:
        m._drop_payload(chunk)
    chunk.shard, chunk.w_tier = hollow(chunk.shard_size, m.dtype), "disk"
    count(m.traffic, m.device, disk, 0, chunk.id, "evict", start)


def shard_from_disk(m, chunk, why: str = "fetch") -> None:
    """Bring the chunk's working shard from disk to the host tier (accounted there)."""
    disk = m.disk
    m.host_room(chunk.shard_nbytes, {chunk.id})
    shard = m.host.alloc(chunk.shard_size, m.dtype, f"chunk {chunk.id} shard")
    disk.read_tensor(shard, chunk.id, "shard", why)
    chunk.shard, chunk.w_tier = shard, "host"


def prefetch_shard(m, chunk, allow) -> bool:
    """Start reading a disk-resident working shard into the host tier on an I/O thread; False when the
    host has no room for it without spilling a shard ``allow`` refuses (one needed sooner)."""
    if chunk.w_tier != "disk" or chunk.disk_read is not None:
        return False
    if not m.host_room(chunk.shard_nbytes, {chunk.id}, allow=allow):
        return False
    shard = m.host.alloc(chunk.shard_size, m.dtype, f"chunk {chunk.id} shard")
    chunk.disk_read = m.disk.submit(m.disk.read_tensor, shard, chunk.id, "shard", "prefetch")
    chunk.shard, chunk.w_tier = shard, "host"
    return True


def settle(m, chunk) -> None:
    """Wait for a prefetch read into the chunk's host shard, if one runs."""
    fut = getattr(chunk, "disk_read", None)
    if fut is not None:
        chunk.disk_read = None
        m.disk.wait(fut, chunk.id)


def aliased(m, chunk) -> bool:
    """The chunk's working shard shares its fp32 master's disk region (fp32 working data)."""
    return m.disk.regions.get((chunk.id, "shard"), (0, 0, ""))[-1] == "alias"


# -- optimizer blocks ---------------------------------------------------------------------------------------
def _state_tensors(optim, chunk):
    """``(fake, lo, hi, key, tensor)`` of the per-element states of the chunk's slices."""
    for fake, lo, hi, _ in optim.slices.get(chunk.id, ()):
        for k, t in optim.optim.state.get(fake, {}).items():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                yield fake, lo, hi, k, t


def block_on_disk(chunk) -> bool:
    """Whether any of the chunk's master, gradient or states lives on disk."""
    return bool(chunk.on_disk)


class _Block:
    """The in-memory tensors of one chunk's optimizer block while it is stepped."""

    def __init__(self, chunk, tensors: dict[str, torch.Tensor], bufs: list[torch.Tensor]):
        self.chunk, self.tensors, self.bufs = chunk, tensors, bufs


def _load_block(opt, chunk, take, states_known: set[str]) -> _Block:
    """Read the disk-resident parts of ``chunk``'s block into buffers from ``take(nbytes)`` (I/O thread)."""
    m, disk = opt.manager, opt.manager.disk
    n = chunk.shard_size
    tensors, bufs = {}, []
    for kind in ("master", "grad"):
        if kind in chunk.on_disk:
            buf = take(n * 4)
            bufs.append(buf)
            t = buf[: n * 4].view(torch.float32)
            if kind == "grad" and not chunk.has_grad:
                t.zero_()
            else:
                disk.read_raw(buf, disk.regions[(chunk.id, kind)][0], buf.numel(), chunk.id, "optim_read")
            tensors[kind] = t
    if "states" in chunk.on_disk:
        for k in states_known:
            buf = take(n * 4)
            bufs.append(buf)
            if disk.has(chunk.id, f"state:{k}"):
                disk.read_raw(buf, disk.regions[(chunk.id, f"state:{k}")][0], buf.numel(), chunk.id, "optim_read")
            tensors[f"state:{k}"] = buf[: n * 4].view(torch.float32)
    del m
    return _Block(chunk, tensors, bufs)


def _store_block(opt, block: _Block, give) -> None:
    """Write the block's master and states back (I/O thread); the gradient is consumed, not written."""
    disk, chunk = opt.manager.disk, block.chunk
    for key, t in block.tensors.items():
        if key == "grad":
            continue
        nbytes = t.numel() * 4
        off = disk.region(chunk.id, key, nbytes)
        disk.write_raw(t, off, _round(nbytes) if disk.direct else nbytes, chunk.id, "optim_write")
    for b in block.bufs:
        give(b)


class _BufferSets:
    """Thread-safe take/give over the tier's buffers (the I/O threads take and give too)."""

    def __init__(self, disk: DiskTier):
        self.disk, self.lock = disk, threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            return self.disk.buffers.get(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.disk.buffers.put(buf)


def _bind(opt, block: _Block) -> dict:
    """Point the chunk's master/gradient and its slices' parameters, gradients and states at the block's
    buffers; returns what to restore."""
    chunk, t = block.chunk, block.tensors
    saved = {"master": chunk.master, "grad": chunk.grad_shard}
    if "master" in t:
        chunk.master = t["master"]
    if "grad" in t:
        chunk.grad_shard = t["grad"]
    for fake, lo, hi, _ in opt.slices.get(chunk.id, ()):
        fake.data = chunk.master[lo:hi]
        state = opt.optim.state.get(fake)
        if state and "states" in chunk.on_disk:
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0 and f"state:{k}" in t:
                    state[k] = t[f"state:{k}"][lo:hi]
    return saved


def stream_step(opt, chunks: list, grad_scale: float, without: set[str]) -> None:
    """Step ``chunks`` (their blocks partly on disk) one at a time, double buffered (module note)."""
    m = opt.manager
    disk = m.disk
    disk.drain()  # gradient writes of the backward pass
    sets = _BufferSets(disk)
    known = set(getattr(opt, "_disk_state_keys", ()))
    futs: dict[int, concurrent.futures.Future] = {}
    writes: dict[int, concurrent.futures.Future] = {}

    def start_read(j):
        if j < len(chunks):
            if j - 3 in writes:  # the set block j will use was last used by block j - 3
                disk.wait(writes.pop(j - 3), chunks[j].id)
            futs[j] = disk.submit(_load_block, opt, chunks[j], sets.take, set(known))

    start_read(0)
    for i, chunk in enumerate(chunks):
        start_read(i + 1)
        block = disk.wait(futs.pop(i), chunk.id)
        if grad_scale != 1.0 and "grad" in block.tensors:  # one in memory is unscaled and clipped already
            block.tensors["grad"].mul_(grad_scale)
        saved = _bind(opt, block)
        for fake, lo, hi, name in opt.slices.get(chunk.id, ()):
            fake.grad = None if name in without else chunk.grad_shard[lo:hi]
        opt.optim.step()
        for fake, *_ in opt.slices.get(chunk.id, ()):
            fake.grad = None
        new = set()
        if "states" in chunk.on_disk:
            new = {k for *_, k, _ in _state_tensors(opt, chunk)} - {k[6:] for k in block.tensors if k[:6] == "state:"}
        for k in sorted(new):  # the first step created these states: make room for them in the block
            known.add(k)
            buf = sets.take(chunk.shard_size * 4)
            block.bufs.append(buf)
            block.tensors[f"state:{k}"] = buf[: chunk.shard_size * 4].view(torch.float32)
        _unbind_and_refresh(opt, block, saved, known)
        writes[i] = disk.submit(_store_block, opt, block, sets.give)
    for f in writes.values():
        disk.wait(f)
    opt._disk_state_keys = known


def _unbind_and_refresh(opt, block: _Block, saved: dict, known: set[str]) -> None:
    m, chunk, t = opt.manager, block.chunk, block.tensors
    master = chunk.master  # the buffer view while bound
    if "states" in chunk.on_disk:
        for fake, lo, hi, k, v in list(_state_tensors(opt, chunk)):
            key = f"state:{k}"
            if v.data_ptr() != t[key][lo:hi].data_ptr():
                t[key][lo:hi].copy_(v)
            opt.optim.state[fake][k] = hollow(hi - lo, v.dtype)
    refresh_from(m, chunk, master)
    if "master" in t:
        chunk.master = saved["master"]
    if "grad" in t:
        chunk.grad_shard = saved["grad"]
    for fake, lo, hi, _ in opt.slices.get(chunk.id, ()):
        fake.data = hollow(hi - lo, torch.float32) if "master" in t else chunk.master[lo:hi]


def refresh_from(m, chunk, master: torch.Tensor) -> None:
    """Refresh the chunk's working data from ``master`` (in memory now), wherever the working shard is."""
    if chunk.w_tier == "disk":
        if aliased(m, chunk):
            chunk.disk_clean = True  # the master region, written with the block, is the working shard
            return
        m.disk.write_tensor(master.to(m.dtype), chunk.id, "shard", "param_refresh")
        chunk.disk_clean = True
        return
    settle(m, chunk)
    lo, hi = chunk.shard_range(m.rank)
    target = chunk.shard if m.sharded or chunk.w_tier == "host" else chunk.payload[lo:hi]
    start = time.perf_counter()
    target.copy_(master)
    if chunk.o_tier != chunk.w_tier:
        src = m.host if "master" in chunk.on_disk else m.tier(chunk.o_tier)  # a streamed master is in a buffer
        count(
            m.traffic,
            src,
            m.tier(chunk.w_tier),
            target.numel() * target.element_size(),
            chunk.id,
            "param_refresh",
            start,
        )
    # the disk copy of the working shard is stale, unless it is the master region (written with the block)
    chunk.disk_clean = aliased(m, chunk) and "master" in chunk.on_disk
    if m.sharded:
        m.release(chunk)


def memory_grads(m) -> list[torch.Tensor]:
    """The gradient shards held in memory, of every chunk whose gradient block is not on disk (whether
    or not its master or states are: see [Note: gradients with a disk tier]), after the backward's
    gradient writes have finished; a shard no backward wrote since the last step is zeroed."""
    m.disk.drain()  # the I/O threads may still be writing gradient blocks (and reading them races)
    grads = []
    for c in m.trainable:
        if "grad" in c.on_disk:
            continue
        if not c.has_grad:  # stale contents mean zero
            c.grad_shard.zero_()
            c.has_grad = True
        grads.append(c.grad_shard)
    return grads


def disk_grads_stats(opt, chunks: list, norm_type: float, need_norm: bool) -> tuple[list, list]:
    """Per-chunk surrogates of the disk-resident gradients: ``amax(|g|)`` (inf/NaN propagate) and the
    chunk's ``norm_type``-norm, read in one streamed pass (only when overflow checks or clipping need them)."""
    disk = opt.manager.disk
    amax, norms = [], []
    for c in chunks:
        if "grad" not in c.on_disk:
            continue
        if not c.has_grad:
            continue
        with disk.staged(c.id, "grad", c.shard_size * 4, "grad_check") as buf:  # no chunk-sized temporaries
            g = buf.view(torch.float32)
            if need_norm:
                norms.append(torch.linalg.vector_norm(g, norm_type).reshape(1))
            amax.append(g.abs_().amax().reshape(1))
    return amax, norms


# -- checkpoints ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def paged_in(model, optimizer=None, write_back: bool = True):
    """Load every disk-resident master and optimizer state into fresh host tensors for the duration of
    the block (checkpoint save/load), writing them back after (see [Note: scratch, not checkpoint])."""
    m = model.manager
    if m.disk is None or getattr(m, "paged", False):  # nested: the outer call holds the pages
        yield
        return
    m.disk.drain()
    m.paged = True
    chunks = [c for c in m.chunks if {"master", "states"} & c.on_disk]
    opt = optimizer
    loaded = []
    for c in chunks:
        if "master" in c.on_disk:
            t = torch.empty(c.shard_size, dtype=torch.float32)
            m.disk.read_tensor(t, c.id, "master", "checkpoint")
            c.master = t
        if opt is not None:
            for fake, lo, hi, _ in opt.slices.get(c.id, ()):
                fake.data = c.master[lo:hi]
                if "states" in c.on_disk:
                    for k, v in list(opt.optim.state.get(fake, {}).items()):
                        if isinstance(v, torch.Tensor) and v.dim() > 0 and is_hollow(v):
                            full = torch.empty(c.shard_size, dtype=torch.float32)
                            m.disk.read_tensor(full, c.id, f"state:{k}", "checkpoint")
                            opt.optim.state[fake][k] = full[lo:hi].clone()
        loaded.append(c)
    try:
        yield
    finally:
        m.paged = False
        for c in loaded:
            if write_back and "master" in c.on_disk:
                m.disk.write_tensor(c.master, c.id, "master", "checkpoint")
                if aliased(m, c):
                    c.disk_clean = True
            if opt is not None and "states" in c.on_disk:
                full: dict[str, torch.Tensor] = {}
                for fake, lo, hi, k, v in list(_state_tensors(opt, c)):
                    if write_back:
                        full.setdefault(k, torch.zeros(c.shard_size, dtype=torch.float32))[lo:hi].copy_(v)
                    opt.optim.state[fake][k] = hollow(hi - lo, v.dtype)
                for k, t in full.items():
                    m.disk.write_tensor(t, c.id, f"state:{k}", "checkpoint")
                opt._disk_state_keys = set(getattr(opt, "_disk_state_keys", ())) | set(full)
            if "master" in c.on_disk:
                c.master = hollow(c.shard_size, torch.float32)
                if opt is not None:
                    for fake, lo, hi, _ in opt.slices.get(c.id, ()):
                        fake.data = hollow(hi - lo, torch.float32)


def grad_to_disk(m, chunk, grad: torch.Tensor) -> None:
    """Store the chunk's reduced gradient shard in its disk region (accumulating when it holds one)."""
    grad = grad.float()
    if chunk.has_grad:  # gradient accumulation: read, add, write
        m.disk.drain()
        cur = torch.empty(chunk.shard_size, dtype=torch.float32)
        m.disk.read_tensor(cur, chunk.id, "grad", "grad_accumulate")
        grad = cur.add_(grad)
    m.disk.write_async(grad.contiguous(), chunk.id, "grad", "grad_offload")


# -- setup ----------------------------------------------------------------------------------------------------
def buffer_bytes(shard_elems: int, chunk_bytes: int, states: int = 2) -> int:
    """Host bytes of the I/O buffers: three block sets (master, gradient, states) and two staging buffers."""
    per = _round(shard_elems * 4) + _ALIGN
    return 3 * (2 + states) * per + 2 * (_round(chunk_bytes) + _ALIGN)


def plan(ddp) -> tuple[dict[str, set[int]], int | None]:
    """Which chunk parts live on disk (``homes``) and, for ``auto``, the host bytes working shards may
    hold. Static: the last fractions of the chunks; auto: see the gemini docs ("Disk tier")."""
    m, cfg = ddp.manager, ddp.config
    last = lambda frac, cs: {c.id for c in cs[len(cs) - round(frac * len(cs)) :]}  # noqa: E731
    train = m.trainable  # a frozen chunk has no block on disk or anywhere ([Note: frozen chunks] in chunk.py)
    if cfg.placement == "static":
        homes = {
            "shard": last(cfg.disk_param_frac, m.chunks),
            "master": last(cfg.disk_param_frac, train),
            "grad": last(cfg.disk_grad_frac, train),
            "states": last(cfg.disk_optim_frac, train),
        }
        return homes, None
    c0 = m.chunks[0]
    avail = cfg.host_memory_budget - buffer_bytes(c0.shard_size, c0.nbytes)
    block = c0.shard_size * 16
    on_host = max(0, int(avail // 2 // block))  # blocks kept on the host: half of what the buffers leave
    disk_blocks = {c.id for c in train[on_host:]}
    homes = {"shard": {c.id for c in m.chunks}, "master": disk_blocks, "grad": disk_blocks, "states": disk_blocks}
    allowance = avail - min(on_host, len(train)) * block
    if allowance < c0.shard_nbytes * (1 + m.sharded):
        need = cfg.host_memory_budget - allowance + c0.shard_nbytes * 2
        raise ValueError(
            f"host_memory_budget={cfg.host_memory_budget} is too small for the disk tier: need {need} bytes "
            f"(I/O buffers {buffer_bytes(c0.shard_size, c0.nbytes)} and two working shards)"
        )
    return homes, allowance


def setup(ddp) -> None:
    """Create the disk tier of ``ddp`` (before materialisation, before any collective): plan, free-space
    check, file; every rank raises the same ValueError for a bad directory or too little space."""
    m, cfg = ddp.manager, ddp.config
    homes, allowance = plan(ddp)
    shard_elems = [c.shard_size for c in m.chunks]
    itemsize = m.chunks[0].payload.element_size()
    need = plan_bytes(shard_elems, itemsize, homes)
    check_directory(cfg.disk_dir, need * m.dp_size)  # ranks of one machine share the directory
    pin = m.device.device.type == "cuda"
    rank = m.rank if m.world_size > 1 else (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    m.disk = DiskTier(cfg.disk_dir, need, rank, m.host, threads=cfg.disk_io_threads, pin=pin)
    m.host.budget = cfg.host_memory_budget
    m.host_allowance = allowance
    m.disk_homed = set(homes["shard"]) if cfg.placement == "static" else set()
    m.disk_plan = homes
    for c in m.chunks:
        c.on_disk = {k for k in ("master", "grad", "states") if c.id in homes[k]}
    m.spill_rank = lambda c: ddp.policy.spill_rank(c, ddp.op_index)


def home(m, chunk) -> None:
    """After materialisation (everything of the chunk on the host): move its disk-homed parts to disk."""
    disk = m.disk
    if disk is None:
        return
    if "master" in chunk.on_disk:
        disk.write_tensor(chunk.master, chunk.id, "master", "placement")
        m.host.free(chunk.master)
        chunk.master = hollow(chunk.shard_size, torch.float32)
    if "grad" in chunk.on_disk:  # zero until the first gradient (has_grad is False)
        disk.region(chunk.id, "grad", chunk.shard_size * 4)
        m.host.free(chunk.grad_shard)
        chunk.grad_shard = hollow(chunk.shard_size, torch.float32)
    if "master" in chunk.on_disk and m.dtype == torch.float32:
        disk.alias(chunk.id, "shard", "master")
        chunk.disk_clean = True
    spill = chunk.id in m.disk_homed or (m.host_allowance is not None and m.host_working_bytes() > m.host_allowance)
    if spill:
        shard_to_disk(m, chunk, "placement")
    elif not m.disk_homed:  # auto: the region a later spill writes to
        disk.region(chunk.id, "shard", chunk.shard_nbytes) if not aliased(m, chunk) else None


def optimizer_step(opt) -> bool:
    """``GeminiOptimizer.step`` with a disk tier: in-memory blocks step at once, disk blocks stream."""
    from colossal.optim import DynamicLossScaler, clip_grad_norm_, has_inf_or_nan

    def _reduce(what: str):  # as GeminiOptimizer's: tagged comm events (no import of it: no cycle)
        return functools.partial(comm.all_reduce, tag=f"gemini.{what}")

    m = opt.manager
    with events.label("step"):
        streamed = [c for c in m.chunks if c.on_disk]
        resident = [c for c in m.chunks if not c.on_disk]
        grads = memory_grads(m)  # resident chunks' and streamed ones' kept in memory: unscaled, clipped here
        check = opt.check_overflow or isinstance(opt.scaler, DynamicLossScaler)
        clip = opt.max_grad_norm is not None
        amax, norms = disk_grads_stats(opt, m.chunks, opt.norm_type, clip) if (check or clip) else ([], [])
        inv = 1.0 / opt.scaler.scale
        if opt.scaler.scale != 1.0:
            opt.scaler.unscale_(grads)
            amax = [a * inv for a in amax]
            norms = [x * inv for x in norms]
        found_inf = check and has_inf_or_nan(grads + amax, group=m.group, all_reduce=_reduce("overflow"))
        if found_inf:
            opt.skipped_steps += 1
        else:
            without = opt._params_without_grad()
            scale = inv
            if clip:
                kw = dict(group=m.group, all_reduce=_reduce("grad_norm"))
                if m.replicated:
                    norm = clip_grad_norm_([], opt.max_grad_norm, opt.norm_type, replicated=grads + norms, **kw)
                else:
                    norm = clip_grad_norm_(grads + norms, opt.max_grad_norm, opt.norm_type, **kw)
                opt.last_grad_norm = norm
                scale = inv * float((opt.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
            for c in resident:
                for fake, lo, hi, name in opt.slices.get(c.id, ()):
                    fake.grad = None if name in without else c.grad_shard[lo:hi]
            for fake, name in opt.empty:
                fake.grad = None if name in without else fake.data.new_zeros(0)
            opt.optim.step()
            for fake, _ in opt.empty:
                fake.grad = None
            for c in resident:
                for fake, *_ in opt.slices.get(c.id, ()):
                    fake.grad = None
                m.refresh_working(c)
            stream_step(opt, streamed, scale, without)
        opt.scaler.update(found_inf)
        opt.zero_grad()
        opt.model.end_iteration(None if found_inf else opt)
        return not found_inf
