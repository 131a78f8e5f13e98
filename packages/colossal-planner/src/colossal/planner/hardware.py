"""What the planner plans for: one machine (or cluster) described by its memory, compute and links.

:class:`Hardware` is a self-validating, JSON-round-tripping record of per-device and per-node
figures. :data:`HARDWARE_PRESETS` holds common cards and nodes from their datasheets,
:func:`hardware_preset` looks one up with overrides, and :func:`this_machine` describes the
machine it runs on without benchmarking it (pass the :class:`~colossal.planner.calibrate.Coefficients`
of ``colossalai plan --calibrate`` for measured figures).

[Note: peak versus achievable figures]
Compute (``peak_flops``) and device memory bandwidth are the vendor's dense datasheet peaks: the
speed model applies its own efficiency to them. Link figures (PCIe, NVLink, InfiniBand) are what
a collective or copy achieves, i.e. the datasheet rate times an achievable fraction stated next to
each preset, because the gap there is large and well known (nccl-tests bus bandwidth). Once
:meth:`Coefficients.apply` has run, every substituted figure is an achieved one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shutil
import tempfile
from typing import Any

import torch

from colossal.comm import as_bytes, as_dtype

__all__ = ["Hardware", "HARDWARE_PRESETS", "hardware_preset", "this_machine"]

DEVICE_TYPES = ("cuda", "cpu")
"""The device types the planner models."""
_DTYPE_NAMES = ("float32", "bfloat16", "float16")
_BYTE_FIELDS = ("device_memory", "host_memory", "pinned_host_memory", "disk_free")
_RATE_FIELDS = (
    "disk_read_bandwidth",
    "disk_write_bandwidth",
    "memory_bandwidth",
    "host_link_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One cluster of identical nodes; every figure is per device or per node, as each field says."""

    name: str
    """Human-readable description, e.g. ``"H100 80GB SXM x8"`` or ``"this machine (cpu)"``."""
    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    devices_per_node: int
    """Devices (GPUs; 1 on a CPU machine) in each node."""
    nodes: int = 1
    """Number of nodes."""
    device_memory: int
    """Bytes of memory per device. On a CPU machine: the host RAM, under the engines' CPU budget rules."""
    host_memory: int
    """Bytes of host RAM per node."""
    pinned_host_memory: int | None = None
    """Bytes of host RAM that may be pinned per node; ``None`` means ``host_memory // 2``."""
    disk_free: int
    """Bytes free in the disk-tier directory, per node (0: no disk tier)."""
    disk_read_bandwidth: float
    """Bytes/s read from the disk tier, per node (shared by its devices)."""
    disk_write_bandwidth: float
    """Bytes/s written to the disk tier, per node (shared by its devices)."""
    peak_flops: dict[str, float] = dataclasses.field(hash=False)
    """Dense FLOP/s per device by dtype name: ``{"float32": .., "bfloat16": .., "float16": ..}``.
    Keys may be given in any :func:`colossal.comm.as_dtype` spelling (``"bf16"``); they are stored
    as the full names. Treat the dict as read-only."""
    memory_bandwidth: float
    """Bytes/s of device memory bandwidth, per device."""
    host_link_bandwidth: float
    """Bytes/s of host<->device copies per device (PCIe); on a CPU machine, memcpy bandwidth."""
    intra_node_bandwidth: float
    """Bytes/s per device of collective *bus* bandwidth inside a node (nccl-tests ``busbw``: NVLink
    for SXM parts; on a CPU machine, gloo over loopback)."""
    inter_node_bandwidth: float
    """Bytes/s per device of collective bus bandwidth between nodes (its share of the node's NICs)."""
    link_latency: float = 1e-5
    """Seconds of fixed cost (alpha) per collective call inside a node."""
    inter_node_latency: float = 2e-5
    """Seconds of fixed cost (alpha) per collective call that crosses nodes."""
    matmul_curve: dict[str, list[tuple[float, float]]] | None = dataclasses.field(default=None, hash=False)
    """Measured matmul FLOP/s by size: dtype name -> ``[(flops of one call, FLOP/s achieved), ...]``
    in increasing size (from :func:`~colossal.planner.calibrate`); ``None``: ``peak_flops`` at every
    size. Small matmuls run far below peak (on a CPU, bf16 ones most of all)."""
    attention_curve: dict[str, list[tuple[float, float]]] | None = dataclasses.field(default=None, hash=False)
    """The same for fused attention (forward + backward of ``scaled_dot_product_attention``);
    ``None``: :meth:`matmul_rate`."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"Hardware.name must be a non-empty string, got {self.name!r}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"Hardware.device_type must be one of {list(DEVICE_TYPES)}, got {self.device_type!r}")
        for field in ("devices_per_node", "nodes"):
            _check_count(field, getattr(self, field))
        for field in _BYTE_FIELDS:
            value = getattr(self, field)
            if value is not None or field != "pinned_host_memory":
                object.__setattr__(self, field, _check_bytes(field, value, allow_zero=field == "disk_free"))
        if self.pinned_host_memory is not None and self.pinned_host_memory > self.host_memory:
            raise ValueError(
                f"Hardware.pinned_host_memory must be <= host_memory ({self.host_memory}), "
                f"got {self.pinned_host_memory}"
            )
        for field in _RATE_FIELDS:
            object.__setattr__(self, field, _check_rate(field, getattr(self, field)))
        for field in ("link_latency", "inter_node_latency"):
            object.__setattr__(self, field, _check_rate(field, getattr(self, field), allow_zero=True))
        object.__setattr__(self, "peak_flops", _check_flops(self.peak_flops))
        for field in ("matmul_curve", "attention_curve"):
            curve = getattr(self, field)
            if curve is not None:
                object.__setattr__(self, field, _check_curve(field, curve))

    @property
    def world_size(self) -> int:
        """Devices in the whole cluster: ``devices_per_node * nodes``."""
        return self.devices_per_node * self.nodes

    @property
    def pinnable_host_memory(self) -> int:
        """Bytes of host RAM that may be pinned per node (``pinned_host_memory`` or half the RAM)."""
        return self.host_memory // 2 if self.pinned_host_memory is None else self.pinned_host_memory

    def flops(self, dtype: torch.dtype | str) -> float:
        """Dense FLOP/s per device for ``dtype`` (a torch dtype or a name such as ``"bf16"``)."""
        return self.peak_flops[_dtype_name(dtype, "dtype")]

    def matmul_rate(self, dtype: torch.dtype | str, flops: float) -> float:
        """FLOP/s of one operator of ``flops`` FLOPs: :attr:`matmul_curve` interpolated on log-log
        axes (clamped at its ends), else the peak."""
        name = _dtype_name(dtype, "dtype")
        return _interpolate((self.matmul_curve or {}).get(name), flops, self.peak_flops[name])

    def attention_rate(self, dtype: torch.dtype | str, flops: float) -> float:
        """FLOP/s of a fused attention kernel of ``flops`` FLOPs (:attr:`attention_curve`, else
        :meth:`matmul_rate`)."""
        name = _dtype_name(dtype, "dtype")
        curve = (self.attention_curve or {}).get(name)
        return _interpolate(curve, flops, 0.0) if curve else self.matmul_rate(dtype, flops)

    def with_(self, **changes: Any) -> Hardware:
        """A copy with ``changes`` (field name -> value) applied and validated."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"Hardware has no field(s) {unknown}; fields are {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **changes)

    def scaled(
        self, *, nodes: int | None = None, devices_per_node: int | None = None, name: str | None = None
    ) -> Hardware:
        """The same devices and nodes, in a different number; per-device and per-node figures stay."""
        changes: dict[str, Any] = {"name": name} if name is not None else {}
        if nodes is not None:
            changes["nodes"] = nodes
        if devices_per_node is not None:
            changes["devices_per_node"] = devices_per_node
        return self.with_(**changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON-safe dict; :meth:`from_dict` reads it back equal."""
        out = {
            f.name: dict(self.peak_flops) if f.name == "peak_flops" else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        for name in ("matmul_curve", "attention_curve"):
            curve = getattr(self, name)
            if curve is not None:
                out[name] = {k: [list(p) for p in v] for k, v in curve.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        """The :class:`Hardware` that :meth:`to_dict` wrote; ``ValueError`` for unknown or missing keys."""
        if not isinstance(data, dict):
            raise ValueError(f"Hardware.from_dict needs a dict, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"Hardware.from_dict: unknown key(s) {unknown}; known keys are {sorted(fields)}")
        required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"Hardware.from_dict: missing key(s) {missing}")
        data = dict(data)
        for name in ("matmul_curve", "attention_curve"):
            if data.get(name) is not None:
                data[name] = {k: [tuple(p) for p in v] for k, v in data[name].items()}
        return cls(**data)


def _check_curve(field: str, curve: Any) -> dict[str, list[tuple[float, float]]]:
    """A ``{dtype name: [(flops, FLOP/s), ...]}`` curve: known dtypes, positive finite pairs, sizes
    increasing."""
    if not isinstance(curve, dict):
        raise ValueError(f"Hardware.{field} must be a dict of dtype -> [(flops, FLOP/s), ...], got {curve!r}")
    out = {}
    for key, points in curve.items():
        name = _dtype_name(key, f"Hardware.{field} key")
        try:
            pairs = [(float(f), float(r)) for f, r in points]
        except (TypeError, ValueError):
            raise ValueError(f"Hardware.{field}[{key!r}] must be (flops, FLOP/s) pairs, got {points!r}") from None
        bad = [p for p in pairs if not (math.isfinite(p[0]) and math.isfinite(p[1]) and p[0] > 0 and p[1] > 0)]
        if not pairs or bad or any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
            raise ValueError(
                f"Hardware.{field}[{key!r}] must be positive finite (flops, FLOP/s) pairs with flops increasing, "
                f"got {points!r}"
            )
        out[name] = pairs
    return out


def _interpolate(curve: list[tuple[float, float]] | None, flops: float, default: float) -> float:
    """``curve`` (``(flops, rate)`` pairs, increasing) at ``flops`` on log-log axes, clamped at its ends."""
    if not curve:
        return default
    if flops <= curve[0][0]:
        return curve[0][1]
    for (f0, r0), (f1, r1) in zip(curve, curve[1:]):
        if flops <= f1:
            t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return curve[-1][1]


def _check_count(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Hardware.{field} must be an int >= 1, got {value!r}")


def _check_bytes(field: str, value: Any, allow_zero: bool = False) -> int:
    """``value`` as an int byte count (integral floats such as ``80e9`` accepted)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Hardware.{field} must be an int number of bytes, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"Hardware.{field} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _check_rate(field: str, value: Any, allow_zero: bool = False) -> float:
    """``value`` as a finite float, > 0 (or >= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"Hardware.{field} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"Hardware.{field} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


def _dtype_name(dtype: torch.dtype | str, what: str) -> str:
    return str(as_dtype(dtype, name=what)).removeprefix("torch.")


def _check_flops(peak_flops: Any) -> dict[str, float]:
    """A fresh ``{dtype name: FLOP/s}`` dict holding each of float32, bfloat16 and float16."""
    if not isinstance(peak_flops, dict):
        raise ValueError(f"Hardware.peak_flops must be a dict of dtype name -> FLOP/s, got {peak_flops!r}")
    out = {
        _dtype_name(k, "Hardware.peak_flops key"): _check_rate(f"peak_flops[{k!r}]", v) for k, v in peak_flops.items()
    }
    missing = [name for name in _DTYPE_NAMES if name not in out]
    if missing:
        raise ValueError(f"Hardware.peak_flops must give {list(_DTYPE_NAMES)}, missing {missing} in {peak_flops}")
    return {name: out[name] for name in _DTYPE_NAMES}


# --- presets ------------------------------------------------------------------------------------
# Datasheet figures, dense (no structured sparsity). See [Note: peak versus achievable figures].
_GiB, _TB = 2**30, 10**12
_NVLINK_ACHIEVABLE = 0.8
"""nccl-tests all-reduce bus bandwidth over NVLink reaches about 80% of the unidirectional link rate
(DGX A100: ~235 GB/s of 300 GB/s; DGX H100 without NVLink SHARP: ~360 GB/s of 450 GB/s)."""
_IB_ACHIEVABLE = 0.9
"""nccl-tests inter-node bus bandwidth reaches about 90% of the InfiniBand line rate per NIC."""
# PCIe x16 achieved host<->device copy rates (pinned memory), ~78% of the raw rate:
_PCIE3, _PCIE4, _PCIE5 = 12e9, 24e9, 50e9  # raw 15.75 / 31.5 / 63 GB/s
_ETH_10G = 0.9 * 1.25e9  # a workstation's 10 GbE NIC
_WORKSTATION = dict(
    nodes=1,
    devices_per_node=1,
    host_memory=64 * _GiB,
    disk_free=1 * _TB,  # a 1 TB NVMe drive, empty, ...
    disk_read_bandwidth=2e9,  # ... read and written through a filesystem
    disk_write_bandwidth=1.5e9,
)


def _card(name: str, **figures: Any) -> Hardware:
    return Hardware(name=name, device_type="cuda", **{**_WORKSTATION, **figures})


# Turing GeForce: fp16 tensor cores give 51.6 TFLOPS with fp16 accumulation but half that with the
# fp32 accumulation that training uses (25.8 TFLOPS); there are no bf16 tensor cores, so bf16 runs
# at the fp32 rate. 6 GiB of GDDR6: torch reports slightly less (the driver and display hold some).
_RTX2060 = dict(
    device_memory=6 * _GiB,
    peak_flops={"float32": 6.45e12, "float16": 25.8e12, "bfloat16": 6.45e12},
    memory_bandwidth=336e9,
    host_link_bandwidth=_PCIE3,
    intra_node_bandwidth=_PCIE3,  # no NVLink: peers talk over PCIe
    inter_node_bandwidth=_ETH_10G,
)
# Ampere GeForce (GA102 whitepaper): fp16/bf16 tensor cores give 71 TFLOPS dense with fp32
# accumulation (142 with fp16 accumulation, which training does not use). 24 GiB of GDDR6X.
_RTX3090 = dict(
    device_memory=24 * _GiB,
    peak_flops={"float32": 35.6e12, "float16": 71e12, "bfloat16": 71e12},
    memory_bandwidth=936e9,
    host_link_bandwidth=_PCIE4,
    intra_node_bandwidth=_PCIE4,  # no NVLink bridge assumed: peers talk over PCIe
    inter_node_bandwidth=_ETH_10G,
)
# Datacenter parts: memory is the decimal datasheet figure, which is below what torch reports
# (e.g. ~79.2 GiB = 85e9 bytes on an 80GB A100/H100): the margin covers the CUDA context and
# allocator fragmentation. "float32" is the non-tensor-core rate (torch does not use TF32 for
# matmuls by default). NVLink figures are bus bandwidth, x _NVLINK_ACHIEVABLE of the unidirectional
# rate; inter-node is one InfiniBand NIC per GPU, as in a DGX, x _IB_ACHIEVABLE.
_A100 = dict(
    peak_flops={"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12},
    host_link_bandwidth=_PCIE4,
    intra_node_bandwidth=_NVLINK_ACHIEVABLE * 300e9,  # NVLink 3: 600 GB/s bidirectional
    inter_node_bandwidth=_IB_ACHIEVABLE * 25e9,  # HDR 200 Gb/s per GPU
)
_H100 = dict(
    device_memory=80 * 10**9,
    peak_flops={"float32": 67e12, "float16": 989e12, "bfloat16": 989e12},
    memory_bandwidth=3350e9,
    host_link_bandwidth=_PCIE5,
    intra_node_bandwidth=_NVLINK_ACHIEVABLE * 450e9,  # NVLink 4: 900 GB/s bidirectional
    inter_node_bandwidth=_IB_ACHIEVABLE * 50e9,  # NDR 400 Gb/s per GPU (ConnectX-7)
)
_H200 = {**_H100, "device_memory": 141 * 10**9, "memory_bandwidth": 4800e9}
# DGX nodes: 2 TB of RAM, and the 30 TB RAID-0 of 8 U.2 NVMe drives as the disk tier (assumed
# empty), at ~1.5 GB/s read and 1 GB/s write achieved per drive through a filesystem under load.
_DGX = dict(
    devices_per_node=8, host_memory=2 * 2**40, disk_free=30 * _TB, disk_read_bandwidth=12e9, disk_write_bandwidth=8e9
)

HARDWARE_PRESETS: dict[str, Hardware] = {
    "rtx2060": _card("GeForce RTX 2060 6GB", **_RTX2060),
    "rtx3090": _card("GeForce RTX 3090 24GB", **_RTX3090),
    "a100-40gb": _card("A100 40GB SXM", device_memory=40 * 10**9, memory_bandwidth=1555e9, **_A100),
    "a100-80gb": _card("A100 80GB SXM", device_memory=80 * 10**9, memory_bandwidth=2039e9, **_A100),
    "h100": _card("H100 80GB SXM", **_H100),
    "h200": _card("H200 141GB SXM", **_H200),
    "dgx-a100": _card(
        "DGX A100 (8x A100 80GB SXM)", device_memory=80 * 10**9, memory_bandwidth=2039e9, **_A100, **_DGX
    ),
    "dgx-h100": _card("DGX H100 (8x H100 80GB SXM)", **_H100, **_DGX),
    "laptop-rtx2060": _card("laptop, RTX 2060 6GB, 16 GiB RAM", **{**_RTX2060, "host_memory": 16 * _GiB}),
    "desktop-rtx3090": _card("desktop, RTX 3090 24GB, 64 GiB RAM", **_RTX3090),
}
"""Common cards (one per node, in a 64 GiB workstation) and nodes, by lookup name."""


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.strip().lower())


def hardware_preset(
    name: str,
    *,
    nodes: int = 1,
    devices: int | None = None,
    host_memory: int | str | None = None,
    disk_free: int | str | None = None,
    **changes: Any,
) -> Hardware:
    """The preset ``name`` (case, spaces, ``_`` and ``-`` ignored: ``"DGX H100"``, ``"a100_80gb"``)
    on ``nodes`` nodes of ``devices`` devices each (default: the preset's), with overrides.

    ``host_memory``/``disk_free`` accept byte strings such as ``"512GiB"``; ``changes`` are any
    other :class:`Hardware` fields. An unknown name raises ``ValueError`` listing the known ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"hardware_preset name must be a string, got {type(name).__name__}")
    by_key = {_key(k): v for k, v in HARDWARE_PRESETS.items()}
    if _key(name) not in by_key:
        close = difflib.get_close_matches(_key(name), list(by_key), n=1, cutoff=0.5)
        hint = f" (did you mean {next(k for k in HARDWARE_PRESETS if _key(k) == close[0])!r}?)" if close else ""
        raise ValueError(f"unknown hardware preset {name!r}{hint}; known presets: {sorted(HARDWARE_PRESETS)}")
    changes["nodes"] = nodes
    if devices is not None:
        changes["devices_per_node"] = devices
    if host_memory is not None:
        changes["host_memory"] = as_bytes(host_memory, "host_memory")
    if disk_free is not None:
        changes["disk_free"] = as_bytes(disk_free, "disk_free")
    return by_key[_key(name)].with_(**changes)


# --- this machine -------------------------------------------------------------------------------
# Without calibration: conservative guesses; run `colossalai plan --calibrate` for real figures.
_CPU_GUESS = dict(
    # A few AVX2/AVX-512 cores; fp16 GEMM on CPUs without AVX512-FP16/AMX is emulated, ~10x slower.
    peak_flops={"float32": 1e11, "bfloat16": 1e11, "float16": 1e10},
    memory_bandwidth=2e10,  # one process on DDR4/DDR5
    host_link_bandwidth=1e10,  # memcpy
    intra_node_bandwidth=1e9,  # gloo over loopback
    inter_node_bandwidth=_ETH_10G,
)
_DISK_GUESS = dict(disk_read_bandwidth=5e8, disk_write_bandwidth=3e8)  # a SATA SSD


def _host_ram() -> int:
    """Bytes of RAM: ``MemTotal`` of ``/proc/meminfo``, else ``os.sysconf`` (pages x page size)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB, meaning KiB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cuda_figures(device_name: str, total_memory: int) -> dict[str, Any]:
    """Compute and link figures of the preset whose card ``device_name`` names (A100 figures if none)."""
    upper = device_name.upper()
    markers = (("H200", "h200"), ("H100", "h100"), ("3090", "rtx3090"), ("2060", "rtx2060"))
    a100 = "a100-80gb" if "A100" in upper and total_memory > 60 * 10**9 else "a100-40gb"
    key = next((k for marker, k in markers if marker in upper), a100)
    preset = HARDWARE_PRESETS[key]
    fields = ("peak_flops", "memory_bandwidth", "host_link_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth")
    return {f: getattr(preset, f) for f in fields}


def this_machine(disk_dir: str | os.PathLike | None = None, *, coefficients: Any = None) -> Hardware:
    """This machine, described in milliseconds without benchmarks.

    Memory is read from the system: with CUDA, ``torch.cuda`` gives the device count and the first
    device's total memory; without it the machine is one ``"cpu"`` device whose memory is the host
    RAM. ``host_memory`` is ``MemTotal`` (all RAM, not what is free now). ``disk_free`` is the free
    space of ``disk_dir`` (default: the temp directory). Compute, bandwidth and latency figures come
    from ``coefficients`` (:func:`colossal.planner.calibrate.calibrate`) when given, else from the
    matching preset (CUDA) or conservative guesses (CPU, disk).
    """
    ram = _host_ram()
    disk_free = shutil.disk_usage(os.fspath(disk_dir) if disk_dir is not None else tempfile.gettempdir()).free
    common = dict(nodes=1, host_memory=ram, disk_free=disk_free, **_DISK_GUESS)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        hardware = Hardware(
            name=f"this machine ({props.name} x{count})",
            device_type="cuda",
            devices_per_node=count,
            device_memory=props.total_memory,
            **_cuda_figures(props.name, props.total_memory),
            **common,
        )
    else:
        hardware = Hardware(
            name="this machine (cpu)", device_type="cpu", devices_per_node=1, device_memory=ram, **_CPU_GUESS, **common
        )
    return hardware if coefficients is None else coefficients.apply(hardware)
