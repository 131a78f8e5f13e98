"""Peak memory of the current process: host RSS high-water mark (resettable on Linux) and the
CUDA allocator's peak when a GPU is in use."""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["reset_peak_memory", "peak_rss_bytes", "current_rss_bytes", "peak_device_bytes"]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_memory() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux ``clear_refs``) and the CUDA peak;
    ``False`` when the host mark cannot be reset (then :func:`peak_rss_bytes` is the process peak)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Host RSS high-water mark in bytes (since the last successful :func:`reset_peak_memory`)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Current host RSS in bytes (0 where ``/proc`` is unavailable)."""
    return (_status_kb("VmRSS") or 0) * 1024


def peak_device_bytes() -> int:
    """CUDA allocator peak in bytes (0 without CUDA)."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
