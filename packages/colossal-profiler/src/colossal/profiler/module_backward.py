"""Module backward spans (opt-in): full backward pre/post hooks down to the depth limit.

[Note: why backward module spans are opt-in]
``register_full_backward_hook`` routes a module's inputs and outputs through an identity autograd
function so that it can see their gradients. That costs an autograd node per hooked module and
makes in-place changes of those tensors an error ("a view ... is being modified inplace"), which
some models do. So it is off unless ``module_backward=True``. A module whose inputs need no
gradient (an embedding of token ids) gets a zero-length span: autograd calls both hooks when the
gradient of its output arrives.
"""

from __future__ import annotations

from typing import Any

import torch

from colossal.profiler.modules import modules_to_depth
from colossal.profiler.spans import OpenSpan, SpanOpener

__all__ = ["BackwardModuleRecorder"]

TRACK = "modules_backward"


class BackwardModuleRecorder:
    """A span per module backward, from its output gradients to its input gradients."""

    def __init__(self, spans: SpanOpener) -> None:
        self._spans = spans
        self._handles: list[Any] = []
        self._stack: list[OpenSpan] = []

    def attach(self, model: torch.nn.Module, depth: int) -> None:
        """Hook every module down to ``depth`` (idempotent)."""
        if self._handles:
            return
        for name, mod in modules_to_depth(model, depth):
            self._handles.append(mod.register_full_backward_pre_hook(self._pre(name)))
            self._handles.append(mod.register_full_backward_hook(self._post(name)))

    def detach(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()

    def _pre(self, name: str) -> Any:
        def hook(module: torch.nn.Module, grad_output: Any) -> None:
            self._stack.append(self._spans.open(name, TRACK))

        return hook

    def _post(self, name: str) -> Any:
        def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
            # Pop down to this module's entry: entries above it belong to backwards that never finished.
            while self._stack and self._stack[-1].name != name:
                self._stack.pop()
            if self._stack:
                self._spans.close(self._stack.pop())

        return hook
