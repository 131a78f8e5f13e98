"""Which implementation the fused operators use: plain torch everywhere, or a compiled path.

[Note: fused operator backends]
Every fused operator in :mod:`fastfold.ops` has one pure-torch definition, which is the reference.
The ``COMPILE`` backend hands that same definition to ``torch.compile`` (Inductor fuses the
elementwise chain into one kernel: C++/OpenMP on CPU, Triton on CUDA), so the two paths cannot
drift apart semantically; they differ only by floating-point reassociation. Compilation is lazy
(first call) and cached per function.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

__all__ = ["OpsBackend", "get_ops_backend", "set_ops_backend", "dispatch"]


class OpsBackend(enum.StrEnum):
    """Implementation used by the fused operators."""

    TORCH = "torch"
    """Eager pure-torch composition (the reference; always available)."""
    COMPILE = "compile"
    """The same functions through ``torch.compile`` (Inductor: C++ on CPU, Triton on CUDA)."""


_state = {"backend": OpsBackend.TORCH}
_compiled: dict[Callable, Callable] = {}


def set_ops_backend(backend: OpsBackend | str) -> None:
    """Select the backend for every fused operator (process-wide)."""
    try:
        _state["backend"] = OpsBackend(backend)
    except ValueError:
        raise ValueError(f"backend must be one of {[b.value for b in OpsBackend]}, got {backend!r}") from None


def get_ops_backend() -> OpsBackend:
    """The backend currently selected."""
    return _state["backend"]


def dispatch(fn: Callable) -> Callable:
    """``fn`` itself under ``TORCH``; its (cached) ``torch.compile`` version under ``COMPILE``."""
    if _state["backend"] is OpsBackend.TORCH:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]
