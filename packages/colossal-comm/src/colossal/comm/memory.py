"""The process's host memory as the kernel counts it: resident set size now and at its peak.

One reader for every package (Gemini's stats and budgets, the CLI meters, FastFold's memory
figures). ``/proc/self/status`` gives ``VmRSS`` (now) and ``VmHWM`` (the high-water mark since the
process started, or since :func:`reset_peak_rss`); only its head is read (both lie in the first
~330 bytes), so a per-step reading adds a few hundred bytes to the process's ``rchar``. Without
``/proc`` (not Linux) the peak falls back to ``getrusage`` and the current size is ``None``.
"""

from __future__ import annotations

import os
import sys

try:
    import resource
except ImportError:  # Windows
    resource = None

__all__ = ["reset_peak_rss", "rss_and_peak_bytes"]


def _status(*fields: str) -> list[int | None]:
    """``fields`` of ``/proc/self/status`` in bytes (``None`` where absent)."""
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY)
    except OSError:
        return [None] * len(fields)
    try:
        text = os.read(fd, 768)
        if not all(f.encode() + b":" in text for f in fields):  # a long line before them (Groups)
            text += os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    found = {}
    for line in text.decode(errors="replace").splitlines():
        name, _, rest = line.partition(":")
        if name in fields and rest.split():
            found[name] = int(rest.split()[0]) * 1024
    return [found.get(f) for f in fields]


def rss_and_peak_bytes() -> tuple[int | None, int | None]:
    """The process's resident set size now and its peak (``VmRSS``, ``VmHWM``) in one read; ``None``
    where ``/proc`` is absent (the peak then falls back to ``getrusage``: the process's whole life)."""
    rss, peak = _status("VmRSS", "VmHWM")
    if peak is None and resource is not None:  # not Linux: ru_maxrss (after fork: the parent's too)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return rss, peak


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux ``/proc/self/clear_refs``); ``False``
    when it cannot be reset (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
