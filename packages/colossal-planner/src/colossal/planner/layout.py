"""A layout: which engine holds the model states, and how the ranks split the work."""

from __future__ import annotations

import dataclasses
import math

import torch

from colossal.comm import as_bytes, as_dtype

__all__ = ["Layout", "TierBytes", "OPTIMIZER_STATES"]

ENGINES = ("ddp", "zero", "gemini", "hybrid")
TP_MODES = ("1d", "2d", "2.5d", "3d")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
SP_KINDS = ("ring", "all_to_all")
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2,
    "adam": 2,
    "hybridadam": 2,
    "lamb": 2,
    "lars": 1,
    "sgd": 0,
    "sgd-momentum": 1,
}
"""fp32 state tensors per parameter element of each optimizer (Adam's two moments, ...)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One way to run the step: the engine, its knobs, and the parallel degrees.

    The knobs have the engines' own names and defaults (``colossal.zero.ZeroConfig``,
    ``colossal.gemini.GeminiConfig``, ``colossalai.booster.TorchDDPPlugin``).
    """

    engine: str
    """``"ddp"`` (torch DDP), ``"zero"`` (``colossal.zero``), ``"gemini"`` (``colossal.gemini``) or
    ``"hybrid"`` (``colossalai.booster.HybridParallelPlugin``: dp x tp x sp x pp x ep, with DDP or
    ZeRO 1/2 over dp; :mod:`colossal.planner.hybrid`)."""
    dp: int = 1
    """Data-parallel ranks."""
    tp: int = 1
    """Hybrid: tensor-parallel ranks (``tp_size``)."""
    tp_mode: str = "1d"
    """Hybrid: ``"1d"``, ``"2d"``, ``"2.5d"`` or ``"3d"``."""
    tp_depth: int = 1
    """Hybrid 2.5D: the depth ``d`` of ``tp = q^2 d``."""
    sp: int = 1
    """Hybrid: sequence-parallel ranks (``sp_size``)."""
    sp_kind: str = "ring"
    """Hybrid: ``"ring"`` or ``"all_to_all"`` attention."""
    pp: int = 1
    """Hybrid: pipeline stages (``pp_size``)."""
    microbatches: int | None = None
    """Hybrid: micro-batches per step (``num_microbatches``; ``None``: ``pp``)."""
    pp_schedule: str = "1f1b"
    """Hybrid: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zero_bubble"``."""
    pp_virtual: int = 1
    """Hybrid interleaved schedule: chunks per rank."""
    ep: int = 1
    """Hybrid: expert-parallel ranks (``ep_size``; they split the dp ranks)."""
    precision: torch.dtype = torch.float32
    """Working precision of parameters and activations (``"bf16"``... accepted)."""
    zero_stage: int = 0
    """ZeRO stage 1-3 (``engine="zero"``)."""
    offload: bool = False
    """ZeRO-Offload: fp32 masters, their gradients and optimizer states on the host."""
    bucket_numel: int = 2**22
    """ZeRO stages 1/2: elements per gradient bucket (``ZeroConfig.bucket_numel``)."""
    ddp_bucket_cap_mb: int = 25
    """DDP: gradient bucket size in MiB."""
    placement: str = "auto"
    """Gemini: ``"static"`` or ``"auto"``."""
    chunk_size: int | None = None
    """Gemini: elements per chunk (``None``: Gemini's own search)."""
    device_budget: int | None = None
    """Gemini: device bytes it may use (``None``: the device's memory)."""
    host_budget: int | None = None
    """Gemini with a disk tier: host bytes it may use."""
    disk: bool = False
    """Gemini: spill to a disk tier."""
    offload_optim_frac: float = 1.0
    """Gemini static placement: fraction of optimizer blocks on the host (Gemini's default: all)."""
    offload_param_frac: float = 0.0
    """Gemini static placement: fraction of working chunks on the host."""
    disk_param_frac: float = 0.0
    """Gemini with a disk tier: fraction of working chunks whose home is the disk."""
    disk_grad_frac: float = 0.0
    """Gemini with a disk tier: fraction of gradient blocks on the disk."""
    disk_optim_frac: float = 0.0
    """Gemini with a disk tier: fraction of optimizer blocks on the disk."""
    keep_gathered: bool = False
    """Gemini: keep chunks gathered (unsharded) on every rank."""
    prefetch: int | None = None
    """Items whose all-gather starts ahead: Gemini (sharded) chunks ahead of their operator
    (``GeminiConfig.prefetch``), ZeRO-3 units ahead of the running one (``ZeroConfig.prefetch``);
    ``None``: the engine's default (2 chunks, 1 unit)."""
    optimizer: str = "adamw"
    """Optimizer family (its state count: :data:`OPTIMIZER_STATES`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", as_dtype(self.precision))
        if self.engine not in ENGINES:
            raise ValueError(f"Layout.engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("dp", "bucket_numel", "ddp_bucket_cap_mb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {v!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):  # fmt: skip
            raise ValueError(f"Layout.chunk_size must be a positive int or None, got {self.chunk_size!r}")
        for name in ("device_budget", "host_budget"):  # "2GiB" as the engines take it
            v = getattr(self, name)
            if v is not None:
                v = as_bytes(v, f"Layout.{name}")
                if v < 1:
                    raise ValueError(f"Layout.{name} must be positive, got {v!r}")
                object.__setattr__(self, name, v)
        for name in ("tp", "tp_depth", "sp", "pp", "pp_virtual", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {v!r}")
        if self.microbatches is None:
            object.__setattr__(self, "microbatches", self.pp)
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"Layout.microbatches must be a positive int or None, got {m!r}")
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"Layout.tp_mode must be one of {TP_MODES}, got {self.tp_mode!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"Layout.pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if self.sp_kind not in SP_KINDS:
            raise ValueError(f"Layout.sp_kind must be one of {SP_KINDS}, got {self.sp_kind!r}")
        degrees = {n: getattr(self, n) for n in ("tp", "sp", "pp", "ep", "pp_virtual", "tp_depth")}
        if self.engine != "hybrid":
            extra = {n: v for n, v in degrees.items() if v != 1}
            if extra:
                raise ValueError(f"Layout({', '.join(f'{n}={v}' for n, v in extra.items())}) needs engine='hybrid', "
                                 f"got engine={self.engine!r}")  # fmt: skip
        else:
            self._check_hybrid()
        if self.engine == "zero" and self.zero_stage not in (1, 2, 3):
            raise ValueError(f"Layout.zero_stage must be 1, 2 or 3 for engine='zero', got {self.zero_stage!r}")
        if self.placement not in ("static", "auto"):
            raise ValueError(f"Layout.placement must be 'static' or 'auto', got {self.placement!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"Layout.optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.prefetch is None:
            object.__setattr__(self, "prefetch", 2 if self.engine == "gemini" else 1)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Layout.prefetch must be an int >= 0, got {self.prefetch!r}")
        for name in (
            "offload_optim_frac",
            "offload_param_frac",
            "disk_param_frac",
            "disk_grad_frac",
            "disk_optim_frac",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ValueError(f"Layout.{name} must be in [0, 1], got {v!r}")

    def _check_hybrid(self) -> None:
        """The degrees ``HybridParallelPlugin`` accepts together (its own checks, restated)."""
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"Layout.zero_stage must be 0 (DDP), 1 or 2 for engine='hybrid', got {self.zero_stage!r}")
        if self.offload:
            raise ValueError("Layout.offload is ZeRO-Offload (engine='zero'); the hybrid plugin does not offload")
        tp, mode, d = self.tp, self.tp_mode, self.tp_depth
        if mode == "2d" and math.isqrt(tp) ** 2 != tp:
            raise ValueError(f"Layout.tp={tp} with tp_mode='2d' must be a square q^2")
        if mode == "2.5d" and (tp % d or math.isqrt(tp // d) ** 2 != tp // d):
            raise ValueError(f"Layout.tp={tp} with tp_mode='2.5d' must be q^2 x tp_depth (tp_depth={d})")
        if mode == "3d" and round(tp ** (1 / 3)) ** 3 != tp:
            raise ValueError(f"Layout.tp={tp} with tp_mode='3d' must be a cube q^3")
        if d != 1 and mode != "2.5d":
            raise ValueError(f"Layout.tp_depth={d} goes with tp_mode='2.5d', got tp_mode={mode!r}")
        if self.pp == 1 and (self.pp_virtual > 1 or self.microbatches > 1):
            raise ValueError(f"Layout.pp_virtual={self.pp_virtual} and microbatches={self.microbatches} need pp > 1 "
                             "(the plugin splits a step into micro-batches only for its pipeline)")  # fmt: skip
        if self.precision == torch.float16 and self.zero_stage:
            raise ValueError("engine='hybrid' with zero_stage 1/2 does not run fp16 (the plugin refuses it); use bf16")
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved":
            raise ValueError(f"Layout.pp_virtual={self.pp_virtual} needs pp_schedule='interleaved', "
                             f"got {self.pp_schedule!r}")  # fmt: skip
        if self.pp > 1 and self.pp_schedule == "interleaved" and self.microbatches % self.pp:
            raise ValueError(f"pp_schedule 'interleaved' needs microbatches divisible by pp={self.pp}, "
                             f"got microbatches={self.microbatches}")  # fmt: skip
        if self.ep > 1:
            if (self.dp * self.sp) % self.ep:
                raise ValueError(f"Layout.ep={self.ep} must divide the dp x sp ranks ({self.dp} x {self.sp})")
            if tp > 1 and mode != "1d":
                raise ValueError(f"Layout.ep={self.ep} composes with 1D tensor parallelism only, got tp_mode={mode!r}")

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.dp * self.tp * self.sp * self.pp

    @property
    def states(self) -> int:
        """fp32 optimizer state tensors per trainable element."""
        return OPTIMIZER_STATES[self.optimizer]

    @property
    def engine_key(self) -> str:
        """The engine and its mode without the degrees: ``"zero3+offload"``, ``"gemini-auto+disk"``
        (the key of :attr:`colossal.planner.Coefficients.engine_overhead`)."""
        if self.engine == "zero":
            return f"zero{self.zero_stage}" + ("+offload" if self.offload else "")
        if self.engine == "gemini":
            return f"gemini-{self.placement}" + ("+disk" if self.disk else "")
        if self.engine == "hybrid":
            return "hybrid" + (f"+zero{self.zero_stage}" if self.zero_stage else "")
        return "ddp"

    @property
    def precision_name(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``: the spelling ``colossalai train --precision`` and the
        Booster's ``mixed_precision`` take."""
        return _NAMES[self.precision]

    @property
    def label(self) -> str:
        """A short human name: ``"zero3+offload dp4 bf16"``."""
        name = self.engine_key
        if self.engine == "gemini" and self.placement == "static" and self.offload_optim_frac < 1.0:
            name += f" optim{100 * (1 - self.offload_optim_frac):.0f}%@device"
        prec = self.precision_name
        if self.engine == "hybrid":
            parts = [f"dp{self.dp}"]
            if self.tp > 1:
                parts.append(f"tp{self.tp}" + (f"({self.tp_mode}" + (f" d{self.tp_depth}" if self.tp_depth > 1 else "")
                                                + ")" if self.tp_mode != "1d" else ""))  # fmt: skip
            if self.sp > 1:
                parts.append(f"sp{self.sp}" + ("(a2a)" if self.sp_kind == "all_to_all" else ""))
            if self.pp > 1:
                v = f" v{self.pp_virtual}" if self.pp_virtual > 1 else ""
                parts.append(f"pp{self.pp}({self.pp_schedule} m{self.microbatches}{v})")
            if self.ep > 1:
                parts.append(f"ep{self.ep}")
            return f"{name} {' '.join(parts)} {prec}"
        return f"{name} dp{self.dp} {prec}"


@dataclasses.dataclass(frozen=True, slots=True)
class TierBytes:
    """Peak bytes per memory tier of one rank."""

    device: int
    """The compute device (on a CPU-only machine: the accounted device tier, in host RAM)."""
    pinned_host: int = 0
    """Page-locked host memory (CUDA only: the engines pin what they copy asynchronously)."""
    host: int = 0
    """Pageable host memory."""
    disk: int = 0
    """Bytes in the disk tier's files."""

    @property
    def host_total(self) -> int:
        """Pinned + pageable host bytes."""
        return self.pinned_host + self.host

    def to_dict(self) -> dict[str, int]:
        """JSON-safe form."""
        return {"device": self.device, "pinned_host": self.pinned_host, "host": self.host, "disk": self.disk}
