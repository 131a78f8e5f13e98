"""One spelling and one type per knob across the packages: precision, byte budgets, prefetch depths
and offload fractions.

Every engine and plugin that takes a precision (``GeminiDDP(mixed_precision=)``,
``ZeroOptimizer(mixed_precision=/param_dtype=)``, ``Booster(mixed_precision=)``) or a byte budget
(``device_memory_budget``, ``host_memory_budget``, the CLI's ``--device-budget``) reads it through
these two functions, so each accepts the same values and rejects the same ones with the same message:

- a precision is a ``torch.dtype`` (``torch.float32``, ``torch.float16``, ``torch.bfloat16``) or its
  name: ``"fp32"``/``"float32"``/``"no"``, ``"fp16"``/``"float16"``/``"half"``, ``"bf16"``/``"bfloat16"``;
- a byte count is a positive ``int`` (or a float with an integral value: ``4e9``) or a string such
  as ``"64MiB"``, ``"1.5GiB"``, ``"512MB"``, ``"1e9"`` (binary units KiB/MiB/GiB/TiB, decimal
  kB/MB/GB/TB, case-insensitive, spaces allowed);
- a prefetch depth (``prefetch`` of ``GeminiDDP`` and ``ZeroOptimizer``: how many chunks or units
  are gathered ahead) is an ``int >= 0`` (``0`` gathers on demand); a ``bool`` is refused, since
  ``True`` would not say how far ahead (``as_count``);
- an offload fraction (``offload_optim_frac``, ``offload_param_frac``, ``disk_*_frac``) is a
  number in [0, 1] (``as_fraction``).
"""

from __future__ import annotations

import math
import re

import torch

__all__ = ["PRECISIONS", "as_bytes", "as_count", "as_dtype", "as_fraction"]

PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "no": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
"""Every accepted precision name -> its dtype."""

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


def as_dtype(value: torch.dtype | str, name: str = "mixed_precision") -> torch.dtype:
    """``value`` as one of the three float dtypes; ``ValueError``/``TypeError`` naming ``name``, the
    value and the accepted spellings otherwise."""
    if isinstance(value, torch.dtype):
        if value in (torch.float32, torch.float16, torch.bfloat16):
            return value
        raise ValueError(f"{name} must be torch.float32, torch.float16 or torch.bfloat16, got {value}")
    if isinstance(value, str):
        dtype = PRECISIONS.get(value.strip().lower())
        if dtype is not None:
            return dtype
        raise ValueError(f"{name} must be a torch dtype or one of {sorted(PRECISIONS)}, got {value!r}")
    raise TypeError(f"{name} must be a torch.dtype or a string such as 'bf16', got {type(value).__name__}")


def as_bytes(value: int | str, name: str) -> int:
    """``value`` as a positive byte count (an ``int``, or a string with a unit: module note);
    ``ValueError``/``TypeError`` naming ``name`` and the value otherwise."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # 4e9
    if isinstance(value, bool) or not isinstance(value, int | str):
        kind = type(value).__name__
        raise TypeError(f"{name} must be a byte count (an int, or a string such as '64MiB'), got {kind} {value!r}")
    if isinstance(value, str):
        match = _SIZE.match(value.lower())
        if match is None or match[2] not in _UNITS:
            raise ValueError(f"{name} must look like '64MiB', '2GiB', '512MB' or a byte count, got {value!r}")
        number = float(match[1]) * _UNITS[match[2]]
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite byte count, got {value!r}")
        parsed = int(number)
    else:
        parsed = value
    if parsed <= 0:
        raise ValueError(f"{name} must be a positive byte count, got {value!r}")
    return parsed


def as_count(value: int, name: str) -> int:
    """``value`` as an ``int >= 0`` (a prefetch depth: module note); ``TypeError`` for a ``bool`` or a
    non-integer, ``ValueError`` for a negative one, each naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (0 turns it off, 1 is one ahead)" if isinstance(value, bool) else ""
        raise TypeError(f"{name} must be an int >= 0{hint}, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def as_fraction(value: float, name: str) -> float:
    """``value`` as a float in [0, 1] (an offload fraction: module note); ``TypeError`` for a ``bool``
    or a non-number, ``ValueError`` outside [0, 1], each naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__} {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)
