"""Phase spans: forward (root module hooks), backward (autograd hooks), optimizer (step hooks).

[Note: finding the backward phase without patching]
The forward post-hook of the root module registers a gradient hook on the first output that
requires grad. Autograd calls it when the gradient reaches the model's output, i.e. when the
backward through the model starts; the hook then queues an engine callback, which autograd runs
when the whole backward pass has finished. Nothing is wrapped or patched, and a forward run
without grad (evaluation) simply records no backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from colossal.profiler.optimizers import hook_step
from colossal.profiler.spans import OpenSpan, SpanOpener

__all__ = ["PhaseRecorder"]

TRACK = "phases"


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


class PhaseRecorder:
    """Hooks the model and optimizer for forward/backward/optimizer spans; ``phase()`` for user spans.

    ``boundary(label)`` (the memory sampler) is called at the end of every phase: memory at a
    phase's start is that at the previous phase's end, so sampling only ends halves the cost.
    """

    def __init__(self, spans: SpanOpener, boundary: Callable[[str], None] | None) -> None:
        self._spans, self._boundary = spans, boundary or (lambda label: None)
        self._handles: list[Any] = []
        self._forward: list[OpenSpan] = []
        self._optimizer: OpenSpan | None = None
        self._backward: OpenSpan | None = None

    def attach(self, model: torch.nn.Module | None, optimizer: Any) -> None:
        """Register the hooks (idempotent)."""
        if self._handles:
            return
        if model is not None:
            self._handles += [
                model.register_forward_pre_hook(self._fwd_pre),
                model.register_forward_hook(self._fwd_post),
            ]
        if optimizer is not None:  # a torch optimizer or a wrapper: see [Note: wrapped optimizers]
            self._handles += hook_step(optimizer, self._opt_pre, self._opt_post)

    def detach(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A user phase span (e.g. ``"data"``, ``"loss"``)."""
        span = self._spans.open(name, TRACK)
        try:
            yield
        finally:
            self._spans.close(span)
            self._boundary(f"{name}:end")

    def _fwd_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._forward.append(self._spans.open("forward", TRACK))

    def _fwd_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self._forward:
            self._spans.close(self._forward.pop())
        self._boundary("forward:end")
        tensor = _first_grad_tensor(out) if torch.is_grad_enabled() else None
        if tensor is not None:
            tensor.register_hook(self._bwd_start)

    def _bwd_start(self, grad: torch.Tensor) -> None:
        if self._backward is None:
            self._backward = self._spans.open("backward", TRACK)
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)

    def _bwd_end(self) -> None:
        if self._backward is not None:
            self._spans.close(self._backward)
            self._backward = None
            self._boundary("backward:end")

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer = self._spans.open("optimizer", TRACK)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._optimizer is not None:
            self._spans.close(self._optimizer)
            self._optimizer = None
        self._boundary("optimizer:end")
