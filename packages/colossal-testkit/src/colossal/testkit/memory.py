"""Measured memory: every byte torch's allocators hand out, from torch's own profiler.

``torch.profiler`` with ``profile_memory=True`` records each allocation and free of the CPU and
CUDA allocators (``[memory]`` events, with their byte counts and times). Summed in time order they
give the exact live bytes of every tensor allocated inside the window, whoever allocated it (the
model, autograd, an engine's buffers, a collective's output), which is what the planner's
predictions are checked against. What the allocator does not see (the interpreter, gloo's own
buffers, the allocator's free lists and page rounding) is not in it: for those read RSS.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["AllocationTrace", "measure_allocations"]


@dataclasses.dataclass(slots=True)
class AllocationTrace:
    """Live allocated bytes over a profiled window (filled when :func:`measure_allocations` exits)."""

    events: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    """``(time_ns, signed bytes, device type)`` of every allocation (+) and free (-), in time order."""
    marks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Named spans (``mark(name)`` blocks): ``(start_ns, end_ns)``."""

    def peak(self, span: str | None = None, device_type: str | None = None) -> int:
        """Peak live bytes (since the window opened) inside ``span`` (default: the whole window),
        on ``device_type`` (default: every device)."""
        lo, hi = self.marks[span] if span is not None else (-1, 1 << 62)
        cur, best = 0, None
        for t, n, dev in self.events:
            if device_type is not None and dev != device_type:
                continue
            if t > hi:
                break
            if t >= lo and best is None:
                best = cur
            cur += n
            if t >= lo:
                best = max(best, cur)
        return cur if best is None else best

    def live(self, at_ns: int, device_type: str | None = None) -> int:
        """Live bytes at time ``at_ns``."""
        return sum(n for t, n, dev in self.events if t <= at_ns and (device_type is None or dev == device_type))


class _Marks:
    def __init__(self, trace: AllocationTrace) -> None:
        self._trace = trace

    @contextlib.contextmanager
    def __call__(self, name: str):
        with record_function(f"colossal.testkit::{name}"):
            yield


@contextlib.contextmanager
def measure_allocations():
    """``with measure_allocations() as (trace, mark): ... with mark("step"): ...``.

    Yields the :class:`AllocationTrace` (complete once the block exits) and ``mark``, a context
    manager naming a span to read :meth:`AllocationTrace.peak` over.
    """
    trace = AllocationTrace()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        yield trace, _Marks(trace)
    events = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            dev = str(e.device_type()).rsplit(".", 1)[-1].lower()  # DeviceType.CPU -> "cpu"
            events.append((e.start_ns(), e.nbytes(), dev))
        elif name.startswith("colossal.testkit::"):
            trace.marks[name.split("::", 1)[1]] = (e.start_ns(), e.start_ns() + e.duration_ns())
    events.sort(key=lambda x: x[0])
    trace.events = events
