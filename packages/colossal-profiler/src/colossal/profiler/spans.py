"""Opening and closing spans, mirrored into torch.profiler when it is running."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler as _autograd_profiler

from colossal.profiler.records import Span, StepRecord

__all__ = ["SpanOpener", "OpenSpan"]


class OpenSpan:
    """A span that has started: close it with :meth:`SpanOpener.close`."""

    __slots__ = ("name", "track", "start", "rf", "args")

    def __init__(self, name: str, track: str, start: float, rf: Any) -> None:
        self.name, self.track, self.start, self.rf = name, track, start, rf
        self.args: dict = {}


class SpanOpener:
    """Makes spans on the current step; each span is also a ``record_function`` range when
    ``torch.profiler`` is active, so our phases and modules appear in its trace too.

    The ``record_function`` is only entered while torch's profiler is enabled (one bool read),
    so spans cost nothing extra in torch when nobody is tracing with it.
    """

    def __init__(self, step: Callable[[], StepRecord | None], clock: Callable[[], float]) -> None:
        self._step, self._clock = step, clock

    def open(self, name: str, track: str) -> OpenSpan:
        """Start a span now."""
        rf = None
        if _autograd_profiler._is_profiler_enabled:
            rf = torch.profiler.record_function(f"colossal.profiler::{track}::{name}")
            rf.__enter__()
        return OpenSpan(name, track, self._clock(), rf)

    def close(self, span: OpenSpan) -> Span | None:
        """End ``span`` now and add it to the current step (if one is being recorded)."""
        end = self._clock()
        if span.rf is not None:
            span.rf.__exit__(None, None, None)
        rec = self._step()
        if rec is None:
            return None
        out = Span(span.name, span.track, span.start, end, span.args)
        rec.spans.append(out)
        return out
