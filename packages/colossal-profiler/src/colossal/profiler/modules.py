"""Module spans: a forward pre/post hook pair per module down to a depth limit, plus FLOPs.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (opt-in: it is a dispatch mode that
sees every op). A module's forward FLOPs are the counter's total after its forward minus before,
so nested modules need no name mapping; achieved FLOP/s is that over the span's duration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from colossal.profiler.spans import OpenSpan, SpanOpener

__all__ = ["ModuleRecorder", "modules_to_depth", "unwrapped"]

TRACK = "modules"


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside wrappers that hold it as their only child ``module`` and own no
    parameters or buffers themselves (``DistributedDataParallel``, ``GeminiDDP``, the Booster's
    wrappers, nested): module paths and ``module_depth`` then count from the user's model, as its
    own ``named_modules()`` does."""
    while True:
        children = list(model.named_children())
        if len(children) != 1 or children[0][0] != "module":
            return model
        if any(True for _ in model.parameters(recurse=False)) or any(True for _ in model.buffers(recurse=False)):
            return model
        model = children[0][1]


def modules_to_depth(model: torch.nn.Module, depth: int) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` for every submodule of the user's model (:func:`unwrapped`) whose path has
    1..``depth`` dotted parts."""
    return [(name, mod) for name, mod in unwrapped(model).named_modules() if name and name.count(".") < depth]


class ModuleRecorder:
    """Spans for module forwards; optional FLOP counting over whole steps."""

    def __init__(self, spans: SpanOpener, boundary: Callable[[str], None] | None, flops: bool) -> None:
        self._spans, self._boundary = spans, boundary
        self._handles: list[Any] = []
        self._stack: list[tuple[OpenSpan, int]] = []
        self._count_flops = flops
        self.counter: FlopCounterMode | None = None
        """The FLOP counter active during the current step (when counting)."""

    def attach(self, model: torch.nn.Module, depth: int) -> None:
        """Hook every module down to ``depth`` (idempotent)."""
        if self._handles:
            return
        for name, mod in modules_to_depth(model, depth):
            self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self._handles.append(mod.register_forward_hook(self._post(name)))
        if self._count_flops:
            self._handles.append(model.register_forward_pre_hook(self._start_counting))

    def detach(self) -> None:
        """Remove every hook (and stop counting)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()
        self.stop_counting()

    def stop_counting(self) -> int | None:
        """Leave the FLOP counter (at step end); returns the FLOPs it counted, or None."""
        if self.counter is None:
            return None
        counter, self.counter = self.counter, None
        counter.__exit__(None, None, None)
        return counter.get_total_flops()

    def _start_counting(self, module: torch.nn.Module, args: Any) -> None:
        if self.counter is None:
            self.counter = FlopCounterMode(display=False)
            self.counter.__enter__()

    def _flops(self) -> int:
        return self.counter.get_total_flops() if self.counter is not None else 0

    def _pre(self, name: str) -> Callable[[torch.nn.Module, Any], None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack.append((self._spans.open(name, TRACK), self._flops()))

        return hook

    def _post(self, name: str) -> Callable[[torch.nn.Module, Any, Any], None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            # Pop down to this module's entry: entries above it belong to forwards that raised.
            while self._stack and self._stack[-1][0].name != name:
                self._stack.pop()
            if self._stack:
                self._close(*self._stack.pop())

        return hook

    def _close(self, open_span: OpenSpan, flops_before: int) -> None:
        if self.counter is not None:
            open_span.args["flops"] = self._flops() - flops_before
        span = self._spans.close(open_span)
        if span is not None and "flops" in span.args and span.duration > 0:
            span.args["flops_per_s"] = span.args["flops"] / span.duration
        if self._boundary is not None:
            self._boundary(f"{open_span.name}:end")
