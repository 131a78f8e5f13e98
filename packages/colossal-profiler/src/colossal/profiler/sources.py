"""Finding event sources lazily: colossal.comm, colossal.zero, colossal.gemini are optional.

The profiler depends on torch alone. A sibling package is used only when it is installed, found
with ``importlib.util.find_spec`` and imported on first use, and only through its public
``register_observer`` (any object that has one is a source).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType

__all__ = ["optional_module", "COMM", "MEMORY_SOURCES"]

COMM = "colossal.comm"
"""Module publishing ``CommEvent`` objects."""
MEMORY_SOURCES = ("colossal.zero", "colossal.gemini")
"""Modules publishing ``ChunkMoveEvent`` / ``MemorySample`` objects (duck-typed by ``kind``)."""


def optional_module(name: str) -> ModuleType | None:
    """``name`` imported if it is installed and has ``register_observer``, else None."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return None
    try:
        module = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - a broken optional sibling must not break profiling
        warnings.warn(
            f"colossal.profiler: {name} is installed but failed to import ({err!r}); ignoring it", stacklevel=2
        )
        return None
    return module if callable(getattr(module, "register_observer", None)) else None
