"""Measure this machine in about a minute: the figures ``colossalai plan --calibrate`` saves.

:func:`calibrate` runs bounded microbenchmarks (square matmuls per dtype, a large elementwise add,
host<->device copies, a disk write and read, the dispatch cost of a tiny op, and collectives on
real spawned ranks) and returns :class:`Coefficients`; :meth:`Coefficients.apply` puts them into a
:class:`~colossal.planner.hardware.Hardware`. :func:`save_coefficients`/:func:`load_coefficients`
keep them in :data:`DEFAULT_PATH` between runs.

[Note: calibration budget]
Each benchmark gets a share of ``seconds`` (:data:`_SHARES`): a probe run picks the largest size
whose repeats fit the share, then repeats run until the share is spent (at least three, for a
median). The collective ranks' start-up (process spawn, ``import torch``) comes on top, about
a second or two with the forkserver of :mod:`colossal.comm.testing` warm.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import mmap
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import run_distributed
from colossal.planner.hardware import Hardware

__all__ = ["Coefficients", "calibrate", "load_coefficients", "save_coefficients", "DEFAULT_PATH"]

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
"""The collectives :func:`calibrate` times, by their :mod:`colossal.comm` names."""


def _default_path() -> pathlib.Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache, "colossal", "planner-calibration.json")


DEFAULT_PATH = _default_path()
"""``$XDG_CACHE_HOME/colossal/planner-calibration.json`` (``~/.cache/...`` without the variable), as
at import; ``path=None`` in :func:`save_coefficients`/:func:`load_coefficients` re-reads the variable."""


def _check(owner: str, field: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{owner}.{field} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{owner}.{field} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Coefficients:
    """What :func:`calibrate` measured on one machine; every figure is achieved, not peak."""

    device_type: str
    """``"cuda"`` or ``"cpu"``: the device the figures are for."""
    matmul_flops: dict[str, float] = dataclasses.field(hash=False)
    """FLOP/s of a large square matmul by dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``),
    median of the repeats, with the torch thread count recorded in ``machine``."""
    elementwise_bandwidth: float
    """Bytes/s of a large ``torch.add(a, b, out=c)``, counting the three tensors."""
    copy_bandwidth_h2d: float
    """Bytes/s of a large pinned-host-to-device copy; on a CPU machine, a CPU ``copy_`` (memcpy)."""
    copy_bandwidth_d2h: float
    """Bytes/s of a large device-to-pinned-host copy; on a CPU machine, a CPU ``copy_`` (memcpy)."""
    disk_read_bandwidth: float
    """Bytes/s reading back the file of ``disk_write_bandwidth``, bypassing the page cache as
    ``disk_read_method`` says."""
    disk_write_bandwidth: float
    """Bytes/s writing a 64-256 MiB file with ``os.write`` and ``os.fsync`` (fsync included)."""
    disk_read_method: str
    """How the read avoided the page cache: ``"O_DIRECT"``, ``"fadvise(DONTNEED)"`` (pages dropped
    after the fsync), or ``"page cache"`` (neither available: the read figure may be the RAM's)."""
    collective: dict[str, tuple[float, float]] = dataclasses.field(hash=False)
    """Op name (:data:`COLLECTIVE_OPS`) -> ``(alpha, beta)``: a call of ``nbytes`` takes
    ``alpha + beta * nbytes`` seconds, ``nbytes`` counted as :class:`colossal.comm.CommEvent` does
    (all_gather: the gathered output; reduce_scatter: the input). Fitted over 4 KiB..16 MiB; with
    ``world_size == 1`` nothing was measured and it is ``(0, 1 / copy_bandwidth_h2d)``."""
    world_size: int
    """Ranks the collectives ran on (1: not measured)."""
    op_overhead_seconds: float
    """Host seconds per dispatched operator of a training step (forward and backward of a chain of
    tiny layers: module calls, autograd and dispatch), per operator of the planner's trace."""
    machine: dict[str, Any] = dataclasses.field(hash=False)
    """Where it was measured: ``node``, ``platform``, ``torch``, ``cpu_count``, ``torch_threads``, ``device``."""
    created: str
    """When it was measured: an ISO 8601 UTC timestamp."""
    op_overhead_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict, hash=False)
    """:attr:`op_overhead_seconds` measured per working dtype (``"float32"``, ``"bfloat16"``): a CPU
    runs small bf16 operators several times slower than fp32 ones (conversions in every kernel)."""
    engine_overhead: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict, hash=False)
    """Host seconds an engine adds to a step beyond its operators: ``Layout.engine_key`` ->
    ``(per step, per parameter tensor)``, fitted on two tiny models by ``colossalai plan
    --calibrate`` (the meta-package runs the engines; the planner only reads the figures). Hooks,
    bookkeeping and Python loops of each engine: what no operator count shows."""
    attention_curve: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict, hash=False)
    """Fused attention (``scaled_dot_product_attention``, causal, forward + backward) at three sizes:
    dtype name -> ``[(flops, FLOP/s), ...]``; on a CPU the bf16 backward runs several times slower
    than fp32."""
    matmul_curve: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict, hash=False)
    """Square matmuls of several sizes (CPU 32-512, CUDA 256-4096): dtype name -> ``[(flops of one
    call, FLOP/s), ...]``, smallest first. The roofline reads each operator's rate from it
    (:meth:`Hardware.matmul_rate`): a 64 x 64 matmul runs far below a 2048 x 2048 one."""

    def __post_init__(self) -> None:
        name = "Coefficients"
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"{name}.device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        object.__setattr__(self, "matmul_flops", self._checked_flops())
        rates = ("elementwise_bandwidth", "copy_bandwidth_h2d", "copy_bandwidth_d2h", "op_overhead_seconds")
        for field in (*rates, "disk_read_bandwidth", "disk_write_bandwidth"):
            object.__setattr__(self, field, _check(name, field, getattr(self, field)))
        object.__setattr__(self, "collective", self._checked_collective())
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"{name}.world_size must be an int >= 1, got {self.world_size!r}")
        for field in ("disk_read_method", "created"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"{name}.{field} must be a string, got {getattr(self, field)!r}")
        if not isinstance(self.machine, dict):
            raise ValueError(f"{name}.machine must be a dict, got {self.machine!r}")

    def _checked_flops(self) -> dict[str, float]:
        if not isinstance(self.matmul_flops, dict) or not self.matmul_flops:
            raise ValueError(
                f"Coefficients.matmul_flops must be a non-empty dict of dtype -> FLOP/s, got {self.matmul_flops!r}"
            )
        out = {}
        for key, value in self.matmul_flops.items():
            dtype = cc.as_dtype(key, "Coefficients.matmul_flops key")
            out[str(dtype).removeprefix("torch.")] = _check("Coefficients", f"matmul_flops[{key!r}]", value)
        return out

    def _checked_collective(self) -> dict[str, tuple[float, float]]:
        if not isinstance(self.collective, dict) or sorted(self.collective) != sorted(COLLECTIVE_OPS):
            got = sorted(self.collective) if isinstance(self.collective, dict) else self.collective
            raise ValueError(
                f"Coefficients.collective must map exactly {list(COLLECTIVE_OPS)} to (alpha, beta), got {got}"
            )
        out = {}
        for op in COLLECTIVE_OPS:
            pair = self.collective[op]
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ValueError(f"Coefficients.collective[{op!r}] must be (alpha, beta), got {pair!r}")
            alpha = _check("Coefficients", f"collective[{op!r}] alpha", pair[0], allow_zero=True)
            out[op] = (alpha, _check("Coefficients", f"collective[{op!r}] beta", pair[1]))
        return out

    def bus_bandwidth(self, op: str = "all_reduce") -> float:
        """Bytes/s of ``op``'s bus bandwidth (nccl-tests ``busbw``) from its fitted ``beta``."""
        if op not in self.collective:
            raise ValueError(f"op must be one of {list(COLLECTIVE_OPS)}, got {op!r}")
        factor = cc.bus_factor(op, self.world_size) if self.world_size > 1 else 1.0
        return factor / self.collective[op][1]

    def op_overhead(self, dtype: torch.dtype | str = torch.float32) -> float:
        """Host seconds per operator of a step in ``dtype`` (:attr:`op_overhead_by_dtype`, else
        :attr:`op_overhead_seconds`)."""
        name = str(cc.as_dtype(dtype)).removeprefix("torch.")
        return self.op_overhead_by_dtype.get(name, self.op_overhead_seconds)

    def apply(self, hardware: Hardware) -> Hardware:
        """``hardware`` with the measured figures in place of its own.

        ``peak_flops`` <- ``matmul_flops`` (dtypes not measured keep theirs), ``memory_bandwidth`` <-
        ``elementwise_bandwidth``, ``host_link_bandwidth`` <- the slower copy direction, the disk
        bandwidths, and, when collectives were measured (``world_size > 1``), ``intra_node_bandwidth``
        <- all_reduce's bus bandwidth and ``link_latency`` <- its alpha. Counts, memory sizes and
        inter-node figures stay.
        """
        if hardware.device_type != self.device_type:
            raise ValueError(
                f"coefficients measured on {self.device_type!r} cannot describe {hardware.device_type!r} hardware "
                f"{hardware.name!r}"
            )
        changes: dict[str, Any] = dict(
            peak_flops={**hardware.peak_flops, **self.matmul_flops},
            matmul_curve=dict(self.matmul_curve) or hardware.matmul_curve,
            attention_curve=dict(self.attention_curve) or hardware.attention_curve,
            memory_bandwidth=self.elementwise_bandwidth,
            host_link_bandwidth=min(self.copy_bandwidth_h2d, self.copy_bandwidth_d2h),
            disk_read_bandwidth=self.disk_read_bandwidth,
            disk_write_bandwidth=self.disk_write_bandwidth,
        )
        if self.world_size > 1:
            changes.update(
                intra_node_bandwidth=self.bus_bandwidth("all_reduce"), link_latency=self.collective["all_reduce"][0]
            )
        return hardware.with_(**changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON-safe dict (``(alpha, beta)`` pairs as lists); :meth:`from_dict` reads it back equal."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["collective"] = {op: list(pair) for op, pair in self.collective.items()}
        data["matmul_curve"] = {k: [list(p) for p in v] for k, v in self.matmul_curve.items()}
        data["engine_overhead"] = {k: list(v) for k, v in self.engine_overhead.items()}
        data["attention_curve"] = {k: [list(p) for p in v] for k, v in self.attention_curve.items()}
        return {**data, "matmul_flops": dict(self.matmul_flops), "machine": dict(self.machine)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Coefficients:
        """The :class:`Coefficients` that :meth:`to_dict` wrote; ``ValueError`` for unknown, missing or bad entries."""
        if not isinstance(data, dict):
            raise ValueError(f"Coefficients.from_dict needs a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        data = dict(data)
        data.setdefault("matmul_curve", {})  # files written before the curve existed
        data.setdefault("op_overhead_by_dtype", {})
        data["attention_curve"] = {k: [tuple(p) for p in v] for k, v in data.get("attention_curve", {}).items()}
        data["engine_overhead"] = {k: tuple(v) for k, v in data.get("engine_overhead", {}).items()}
        data["matmul_curve"] = {k: [tuple(p) for p in v] for k, v in data["matmul_curve"].items()}
        if set(data) != names:
            raise ValueError(
                f"Coefficients.from_dict: unknown key(s) {sorted(set(data) - names)}, "
                f"missing key(s) {sorted(names - set(data))}"
            )
        return cls(**data)

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Coefficients:
        """The :class:`Coefficients` that :meth:`to_json` wrote."""
        return cls.from_dict(json.loads(text))


# --- the benchmarks -----------------------------------------------------------------------------
_SHARES = {"matmul": 0.35, "elementwise": 0.08, "copy": 0.08, "overhead": 0.04, "collectives": 0.30}
"""Fraction of ``seconds`` each benchmark may use ([Note: calibration budget]); the disk gets the
rest through its file size (64 MiB below 10 s, 128 MiB below 30 s, else 256 MiB)."""
_MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 8 << 20
"""Bytes per disk write and read call."""
_MAX_REPS = 50


def _timed(fn: Callable[[], Any], sync: Callable[[], None], budget: float, min_reps: int = 3) -> float:
    """Median seconds of ``fn()`` (synchronized) after one warm-up call, repeated until ``budget`` is spent."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < _MAX_REPS and (len(times) < min_reps or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device, sync: Callable[[], None], budget: float) -> float:
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    return _timed(lambda: torch.matmul(a, b, out=c), sync, budget, min_reps=1 if budget == 0 else 3)


def _matmul_flops(device: torch.device, sync: Callable[[], None], budget: float) -> dict[str, float]:
    """FLOP/s per dtype at the largest size (CPU 512-2048, CUDA 2048-8192) whose repeats fit ``budget``."""
    probe_n, sizes = (256, (512, 1024, 1536, 2048)) if device.type == "cpu" else (1024, (2048, 4096, 8192))
    share, out = budget / len(_MATMUL_DTYPES), {}
    for dtype in _MATMUL_DTYPES:
        probe = _matmul_seconds(probe_n, dtype, device, sync, 0.0)
        fits = [n for n in sizes if probe * (n / probe_n) ** 3 * 5 <= share]  # a warm-up and 4 repeats
        n = fits[-1] if fits else probe_n
        out[str(dtype).removeprefix("torch.")] = 2 * n**3 / _matmul_seconds(n, dtype, device, sync, share)
    return out


def _matmul_curve(
    device: torch.device, sync: Callable[[], None], budget: float
) -> dict[str, list[tuple[float, float]]]:
    """FLOP/s of square matmuls of growing size per dtype (see :attr:`Coefficients.matmul_curve`)."""
    sizes = (32, 64, 128, 256, 512) if device.type == "cpu" else (256, 512, 1024, 2048, 4096)
    share = budget / (len(_MATMUL_DTYPES) * len(sizes))
    out = {}
    for dtype in _MATMUL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        out[name] = [(2.0 * n**3, 2.0 * n**3 / _matmul_seconds(n, dtype, device, sync, share)) for n in sizes]
    return out


def _attention_curve(
    device: torch.device, sync: Callable[[], None], budget: float
) -> dict[str, list[tuple[float, float]]]:
    """FLOP/s of causal fused attention, forward + backward, at three sizes per dtype (fp32, bf16)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shapes = [(1, 4, 64, 16), (2, 4, 256, 32), (2, 8, 512, 64)]
    if device.type == "cuda":
        shapes = [(2, 8, 512, 64), (2, 16, 2048, 128), (2, 32, 4096, 128)]
    share = budget / (2 * len(shapes))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        points = []
        for shape in shapes:
            q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
            g = torch.randn(shape, dtype=dtype, device=device)

            def run(q=q, k=k, v=v, g=g):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

            flops = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(
                g.shape, q.shape, k.shape, v.shape
            )
            points.append((float(flops), flops / _timed(run, sync, share)))
        out[str(dtype).removeprefix("torch.")] = points
    return out


def _elementwise_bandwidth(device: torch.device, sync: Callable[[], None], budget: float) -> float:
    numel = 2**25 if device.type == "cpu" else 2**27  # 128 MiB / 512 MiB per tensor: far beyond any cache
    a, b, c = (torch.ones(numel, device=device) for _ in range(3))
    return 3 * a.nbytes / _timed(lambda: torch.add(a, b, out=c), sync, budget)


def _copy_bandwidths(device: torch.device, sync: Callable[[], None], budget: float) -> tuple[float, float]:
    """Bytes/s host->device and device->host (CPU: memcpy one way, then the other)."""
    numel = 2**25 if device.type == "cpu" else 2**26
    host = torch.ones(numel, pin_memory=device.type == "cuda")
    other = torch.zeros(numel, device=device)
    h2d = host.nbytes / _timed(lambda: other.copy_(host), sync, budget / 2)
    d2h = host.nbytes / _timed(lambda: host.copy_(other), sync, budget / 2)
    return h2d, d2h


def _op_overhead(
    device: torch.device, sync: Callable[[], None], budget: float, dtype: torch.dtype = torch.float32
) -> float:
    """Host seconds per dispatched operator of a training step at sizes too small to compute.

    A chain of 16 blocks of ``Linear(8, 8)`` + GELU + LayerNorm runs forward and backward (module
    calls, autograd's graph, the dispatcher: what a real step pays per operator and a bare
    ``torch.add`` loop does not); the median step time over the operators the planner's trace
    counts for the same step.
    """
    from torch import nn

    from colossal.planner.trace import trace_model

    def make() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)) for _ in range(16)])

    def inputs(b: int, s: int) -> tuple:
        return (torch.zeros(b, 8, device=torch.get_default_device()),)

    with torch.device("meta"):
        ops = trace_model(make, batch=4, seq=1, inputs=inputs, loss=lambda out, x: out.sum()).ops
    model = make().to(device=device, dtype=dtype)
    x = torch.randn(4, 8, device=device, dtype=dtype)

    def run() -> float:
        sync()
        start = time.perf_counter()
        model(x).sum().backward()
        sync()
        return time.perf_counter() - start

    run()
    times = [run()]
    while sum(times) < budget and len(times) < 200:
        times.append(run())
    return statistics.median(times) / ops


def _write_all(fd: int, block: bytes) -> None:
    view = memoryview(block)
    while view:
        view = view[os.write(fd, view) :]


def _open_uncached(path: str, direct: bool) -> tuple[int, str]:
    """A read descriptor that bypasses (``direct``) or has dropped the page cache, and how; -1 if unsupported."""
    if direct:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
        except (AttributeError, OSError):  # no O_DIRECT on this OS, or not on this filesystem (tmpfs)
            return -1, ""
    fd = os.open(path, os.O_RDONLY)
    if not hasattr(os, "posix_fadvise"):
        return fd, "page cache"
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the pages are clean after the fsync: dropped
    return fd, "fadvise(DONTNEED)"


def _read_back(path: str, nbytes: int) -> tuple[float, str]:
    """Bytes/s reading ``path`` through ``O_DIRECT`` if possible, else after dropping its cached pages."""
    with mmap.mmap(-1, _CHUNK) as buf:  # page-aligned, as O_DIRECT requires
        for direct in (True, False):
            fd, method = _open_uncached(path, direct)
            if fd < 0:
                continue
            try:
                start = time.perf_counter()
                while os.readv(fd, [buf]) > 0:
                    pass
                return nbytes / (time.perf_counter() - start), method
            except OSError:
                if not direct:  # EINVAL from a filesystem that accepted O_DIRECT at open: retry cached
                    raise
            finally:
                os.close(fd)
    raise AssertionError("unreachable: the cached read returns or raises")


def _disk_bandwidths(directory: str, nbytes: int) -> tuple[float, float, str]:
    """(write bytes/s with fsync, read bytes/s, read method) for a file of ``nbytes`` in ``directory``."""
    free = shutil.disk_usage(directory).free
    nbytes = min(nbytes, free // 4 // _CHUNK * _CHUNK)
    if nbytes < _CHUNK:
        raise ValueError(f"disk_dir {directory!r} has {free} bytes free; calibration writes a file of {4 * _CHUNK}")
    block = os.urandom(_CHUNK)  # incompressible: a compressing filesystem cannot flatter the figure
    fd, path = tempfile.mkstemp(prefix="colossal-calibrate-", suffix=".bin", dir=directory)
    try:
        start = time.perf_counter()
        for _ in range(nbytes // _CHUNK):
            _write_all(fd, block)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - start)
        os.close(fd)
        fd = -1
        read, method = _read_back(path, nbytes)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)
    return write, read, method


# --- collectives, on spawned ranks --------------------------------------------------------------
_COLLECTIVE_SIZES = tuple(4096 * 4**i for i in range(7))
"""Message bytes timed: 4 KiB, 16 KiB, ..., 16 MiB (every other one when ``seconds < 10``)."""


def _collective_call(op: str, nbytes: int, n: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """A call of ``op`` moving about ``nbytes`` (as ``CommEvent.nbytes`` counts), and its exact bytes."""
    numel = max(n, nbytes // 4 // n * n)  # float32, divisible by the group size
    full = torch.zeros(numel, device=device)
    if op == "all_reduce":
        return lambda: cc.all_reduce(full), full.nbytes
    if op == "broadcast":
        return lambda: cc.broadcast(full, src=0), full.nbytes
    shard = torch.zeros(numel // n, device=device)
    if op == "all_gather":
        return lambda: cc.all_gather(shard, out=full), full.nbytes
    if op == "reduce_scatter":
        return lambda: cc.reduce_scatter(full, out=shard), full.nbytes
    raise ValueError(f"op must be one of {list(COLLECTIVE_OPS)}, got {op!r}")


def _time_collective(call: Callable[[], Any], device: torch.device, sync: Callable[[], None], budget: float) -> float:
    """Mean seconds per call over as many calls as ``budget`` allows, the same count on every rank."""
    call()  # warm-up: connections and buffers
    sync()
    start = time.perf_counter()
    call()
    sync()
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # agree on the count (else a rank waits forever); also a barrier
    reps = max(1, min(_MAX_REPS, int(budget / max(probe.item(), 1e-9))))
    start = time.perf_counter()
    for _ in range(reps):
        call()
    sync()
    return (time.perf_counter() - start) / reps


def _collective_rank(ops: tuple[str, ...], sizes: tuple[int, ...], budget: float) -> dict[str, list[tuple[int, float]]]:
    """On each rank of :func:`run_distributed`: ``op -> [(nbytes, seconds per call), ...]``."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    n, out = dist.get_world_size(), {}
    for op in ops:
        points = []
        for size in sizes:
            call, nbytes = _collective_call(op, size, n, device)
            points.append((nbytes, _time_collective(call, device, sync, budget)))
        out[op] = points
    return out


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``t = alpha + beta * nbytes`` by least squares on relative error, so the
    4 KiB points (which fix alpha) weigh as much as the 16 MiB ones (which fix beta); alpha >= 0."""
    w = [1.0 / t**2 for _, t in points]
    s, sx, sy = sum(w), sum(wi * x for wi, (x, _) in zip(w, points)), sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points))
    beta = (s * sxy - sx * sy) / (s * sxx - sx * sx)
    alpha = (sy - beta * sx) / s
    if alpha < 0 or beta <= 0:  # noise on a loaded machine: fit through the origin instead
        alpha, beta = 0.0, sxy / sxx
    return alpha, beta


def _collectives(
    device_type: str, world_size: int, budget: float, sizes: tuple[int, ...]
) -> dict[str, tuple[float, float]]:
    per_point = budget / (len(COLLECTIVE_OPS) * len(sizes))
    backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        ranks = run_distributed(
            _collective_rank,
            world_size,
            COLLECTIVE_OPS,
            sizes,
            per_point,
            backend=backend,
            threads=1,
            timeout=max(60.0, 4 * budget),
        )
    except Exception as exc:
        raise RuntimeError(
            f"timing collectives on {world_size} {backend} ranks failed; calibrate(collectives=False) skips them"
        ) from exc
    fits = {}
    for op in COLLECTIVE_OPS:
        slowest = [(ranks[0][op][i][0], max(r[op][i][1] for r in ranks)) for i in range(len(sizes))]
        fits[op] = _fit(slowest)
    return fits


# --- the entry ----------------------------------------------------------------------------------
def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"calibrate measures 'cpu' and 'cuda' devices, got {str(dev)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(dev)!r} but CUDA is not available on this machine")
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


def _machine(device: torch.device) -> dict[str, Any]:
    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
    }


def calibrate(
    *,
    device: torch.device | str | None = None,
    disk_dir: str | os.PathLike | None = None,
    world_size: int = 2,
    seconds: float = 60.0,
    collectives: bool = True,
) -> Coefficients:
    """Measure ``device`` (default: the current CUDA device, else the CPU) in about ``seconds``.

    The disk is measured in ``disk_dir`` (default: the temp directory). Collectives run on
    ``world_size`` spawned ranks (gloo on CPU; NCCL on CUDA, at most one rank per GPU);
    ``collectives=False`` or a single rank skips them. CPU figures use the current torch thread
    count. Rank start-up comes on top of ``seconds`` ([Note: calibration budget]).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    dev = _resolve_device(device)
    directory = os.fspath(disk_dir) if disk_dir is not None else tempfile.gettempdir()
    if not os.path.isdir(directory):
        raise ValueError(f"disk_dir must be an existing directory, got {directory!r}")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    budget = {name: share * seconds for name, share in _SHARES.items()}
    with torch.profiler.record_function("colossal.planner::calibrate.compute"):
        matmul = _matmul_flops(dev, sync, budget["matmul"] * 0.7)
        curve = _matmul_curve(dev, sync, budget["matmul"] * 0.2)
        attention = _attention_curve(dev, sync, budget["matmul"] * 0.1)
        elementwise = _elementwise_bandwidth(dev, sync, budget["elementwise"])
        h2d, d2h = _copy_bandwidths(dev, sync, budget["copy"])
        overhead = _op_overhead(dev, sync, budget["overhead"] / 2)
        overhead_bf16 = _op_overhead(dev, sync, budget["overhead"] / 2, torch.bfloat16)
    with torch.profiler.record_function("colossal.planner::calibrate.disk"):
        disk_bytes = (64 << 20) if seconds < 10 else (128 << 20) if seconds < 30 else (256 << 20)
        disk_write, disk_read, method = _disk_bandwidths(directory, disk_bytes)
    ranks = min(world_size, torch.cuda.device_count()) if dev.type == "cuda" else world_size
    if collectives and ranks > 1:
        sizes = _COLLECTIVE_SIZES if seconds >= 10 else _COLLECTIVE_SIZES[::2]
        with torch.profiler.record_function("colossal.planner::calibrate.collectives"):
            fits = _collectives(dev.type, ranks, budget["collectives"], sizes)
    else:
        ranks, fits = 1, {op: (0.0, 1.0 / h2d) for op in COLLECTIVE_OPS}
    return Coefficients(
        device_type=dev.type,
        matmul_flops=matmul,
        elementwise_bandwidth=elementwise,
        copy_bandwidth_h2d=h2d,
        copy_bandwidth_d2h=d2h,
        disk_read_bandwidth=disk_read,
        disk_write_bandwidth=disk_write,
        disk_read_method=method,
        collective=fits,
        world_size=ranks,
        op_overhead_seconds=overhead,
        machine=_machine(dev),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        matmul_curve=curve,
        attention_curve=attention,
        op_overhead_by_dtype={"float32": overhead, "bfloat16": overhead_bf16},
    )


def save_coefficients(coefficients: Coefficients, path: str | os.PathLike | None = None) -> pathlib.Path:
    """Write ``coefficients`` as JSON to ``path`` (default: :data:`DEFAULT_PATH`, creating its
    directory), atomically; returns the path written."""
    target = pathlib.Path(path) if path is not None else _default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(coefficients.to_json() + "\n")
    os.replace(tmp, target)
    return target


def load_coefficients(path: str | os.PathLike | None = None) -> Coefficients:
    """The :class:`Coefficients` saved at ``path`` (default: :data:`DEFAULT_PATH`).

    ``FileNotFoundError`` if there is none (run ``colossalai plan --calibrate``); ``ValueError``
    naming the path if it does not hold valid coefficients.
    """
    source = pathlib.Path(path) if path is not None else _default_path()
    try:
        text = source.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no planner calibration at {str(source)!r}: run `colossalai plan --calibrate` to measure this machine"
        ) from None
    try:
        return Coefficients.from_json(text)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{str(source)!r} does not hold planner calibration coefficients: {exc}") from exc
