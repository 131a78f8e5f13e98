"""Shared pieces of the ``bench_claims_*`` scripts (the seed's claims, scaled to a CPU machine).

[Note: largest batch under a memory cap]
Memory is each rank's peak resident set (``ru_maxrss``) in a fresh process (every configuration
runs in new processes through ``colossal.comm.testing.run_distributed``), or the allocator's peak on
CUDA. A configuration is measured at two sizes ``s1 < s2`` in the same processes (the peak is
monotonic, so the second reading is the larger size's); per-rank memory is linear in the batch
(activations) and in the parameter count (model states), so ``peak(s) = a + b s`` through the two
points, and the largest size under the cap is ``floor((cap - a) / b)``. The bench prints ``a`` and
``b`` so the fit can be checked, and the cap, so the claim's ratio (largest size of a configuration
/ largest size of the baseline) can be recomputed for another cap.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import resource
import time
import traceback

import torch

__all__ = [
    "peak_bytes",
    "fit_largest",
    "timed_steps",
    "write_json",
    "rank_or_error",
    "load_note",
]


def peak_bytes() -> int:
    """This process's peak memory: the CUDA allocator's peak, else the peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fit_largest(points: list[tuple[float, int]], cap: int) -> tuple[float, float, int | None]:
    """``(a, b, largest)`` of ``peak = a + b * size`` through two ``(size, peak)`` points (see the
    note); ``largest`` is None when the fit does not grow (b <= 0: memory did not depend on size)."""
    (s1, p1), (s2, p2) = points[:2]
    b = (p2 - p1) / (s2 - s1)
    a = p1 - b * s1
    return a, b, (math.floor((cap - a) / b) if b > 0 else None)


def timed_steps(step, batches, warmup: int = 1) -> float:
    """Seconds for the batches after ``warmup`` (each ``step(batch)`` is one optimizer step)."""
    for batch in batches[:warmup]:
        step(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def rank_or_error(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": ...}`` when the configuration cannot run (reported, not hidden)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (the bench reports why a mode does not apply)
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"error": last[:400]}


def load_note() -> str:
    """The machine's load while the bench ran (it is shared): 1-minute load average / cores."""
    one, _, _ = os.getloadavg()
    return f"load average {one:.1f} on {os.cpu_count()} cores"


def write_json(name: str, payload: dict) -> pathlib.Path:
    """``$COLOSSAL_BENCH_OUT/<name>.json`` (default ``./bench-results``)."""
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
