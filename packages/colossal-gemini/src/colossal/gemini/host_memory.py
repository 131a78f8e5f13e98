"""The process's real host memory: keep the allocator from inflating it (RSS is read by
:func:`colossal.comm.memory.rss_and_peak_bytes`, re-exported here).

[Note: the allocator's peak]
Gemini's host and disk tiers free and re-allocate chunk-sized buffers (fetched shards, gradient
buffers, fp32 masters and optimizer states read from disk) every step. glibc's ``malloc`` serves a
large request with ``mmap`` (returned to the kernel on ``free``) only above its mmap threshold, and
it raises that threshold to the size of every mmapped block that is freed (up to 32 MiB on 64-bit).
After the first chunk is freed, chunk-sized buffers therefore come from the heap, where small
long-lived allocations between them pin the freed space: with 123 MiB of model states, a 12 MiB
device budget (host RAM on the CPU), a 20 MiB host budget and the rest on disk, the process's peak RSS
(VmHWM) exceeded its RSS before Gemini by 363 MiB (3x the states) although the accounted host peak
was 17 MiB; ``malloc_trim`` gave the memory back afterwards, so it was never live data. Fixing the
threshold (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, glibc's initial value) stops the adjustment: every
buffer of 128 KiB or more is its own mapping, given back when freed, and the same run's peak exceeds
the RSS before Gemini by 85 MiB: the two budgets, the I/O buffers and a constant that does not grow
with the model (64 MiB at 219 MiB of states). ``test_gemini_disk.py`` holds the run.

The price is a page fault per page of every new large buffer instead of reused heap pages: 1.2x the
step time of that model on the CPU (batch 4 x 32, device budget 48 MiB; 0.41 s -> 0.50 s), where the
device tier's chunks are host memory too; on CUDA the device chunks and pinned buffers do not come
from ``malloc`` at all. The setting is process-wide, so Gemini applies it only where the user bounded
host memory (a disk tier or a ``host_memory_budget``), only with glibc, and never over a
``MALLOC_MMAP_THRESHOLD_`` the user set: ``MALLOC_MMAP_THRESHOLD_=33554432`` in the environment takes
large buffers from the heap again (the faster step, the larger peak).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from colossal.comm.memory import rss_and_peak_bytes  # the one reader of RSS (re-exported here)

__all__ = ["MMAP_THRESHOLD", "bound_host_allocator", "rss_and_peak_bytes"]

MMAP_THRESHOLD = 128 << 10
"""Bytes from which every allocation is its own mapping once :func:`bound_host_allocator` ran."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_applied: bool | None = None


def bound_host_allocator() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` ([Note: the allocator's peak]); once per
    process. Returns whether the threshold is fixed (``False``: not glibc, or the user's own
    ``MALLOC_MMAP_THRESHOLD_`` is in force)."""
    global _applied
    if _applied is None:
        _applied = False
        if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt  # glibc (and musl lacks it: AttributeError)
            except (OSError, AttributeError):
                return False
            _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _applied
