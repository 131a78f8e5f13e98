"""What debug mode (``COLOSSAL_COMM_DEBUG``) costs per collective: 2 ranks of the test harness
(file store), ``all_reduce`` of 1024 fp32 elements, off and on, twice each (slowest rank's mean).

    python packages/colossal-comm/bench/debug_mode_cost.py

Not a ``bench_*`` script (``nox -s bench`` does not run it): there is no other tool to compare with.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from colossal.comm import all_reduce, set_debug
from colossal.comm.testing import run_distributed


def _time(on: bool, n: int = 300) -> float:
    """Mean microseconds per ``all_reduce`` over ``n`` calls, after 20 warm-up calls."""
    set_debug(on, timeout=60)
    t = torch.ones(1024)
    for _ in range(20):
        all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        all_reduce(t)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    for on in (False, True, False, True):
        us = max(run_distributed(_time, 2, on, timeout=300))
        print(f"debug {'on ' if on else 'off'}: {us:8.0f} us per all_reduce of 1024 fp32")


if __name__ == "__main__":
    main()
