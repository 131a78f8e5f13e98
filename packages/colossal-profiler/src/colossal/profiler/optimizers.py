"""Optimizers the profiler accepts: a ``torch.optim.Optimizer``, or any wrapper around one.

[Note: wrapped optimizers]
Training stacks hand the loop a wrapper (a Booster's boosted optimizer, ZeRO's ``ZeroOptimizer``,
Gemini's ``GeminiOptimizer``, Accelerate's ``AcceleratedOptimizer``) that is not a
``torch.optim.Optimizer`` but has ``step()``. The profiler may not import those packages, so it
duck-types them: the optimizer span is timed around the object's own ``step`` (a torch optimizer's
step hooks, otherwise an instance attribute wrapping the bound method while attached, removed on
detach), so it covers unscaling, clipping and shard refreshes, not only the inner rule; the
optimizer-state bytes are read from the innermost ``torch.optim.Optimizer`` reached through the
usual wrapper fields (``optim``, ``optimizer``, ``inner``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["check_optimizer", "inner_torch_optimizer", "hook_step"]

_FIELDS = ("optim", "optimizer", "inner")  # where wrappers keep what they wrap


def check_optimizer(optimizer: Any) -> None:
    """``TypeError`` unless ``optimizer`` is None, a torch optimizer, or has a callable ``step``."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    if not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a wrapper of one with a step() method "
            f"(a Booster's, ZeRO's or Gemini's optimizer), or None; got {type(optimizer).__name__}"
        )


def inner_torch_optimizer(optimizer: Any, depth: int = 4) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` inside ``optimizer`` (itself if it is one), None if not found."""
    for _ in range(depth + 1):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        own = getattr(optimizer, "__dict__", {})
        optimizer = next((own[f] for f in _FIELDS if own.get(f) is not None), None)
    return None


class _StepWrap:
    """Removable wrapper of an object's ``step`` (restores the class's method on ``remove``)."""

    def __init__(self, obj: Any, pre: Callable, post: Callable) -> None:
        self.obj, original = obj, obj.step

        def step(*args: Any, **kwargs: Any) -> Any:
            pre(obj, args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                post(obj, args, kwargs)

        self.wrapper = step
        obj.step = step

    def remove(self) -> None:
        if self.obj.__dict__.get("step") is self.wrapper:
            del self.obj.step


def hook_step(optimizer: Any, pre: Callable, post: Callable) -> list[Any]:
    """Call ``pre(opt, args, kwargs)`` / ``post(...)`` around every ``optimizer.step()``; removable handles."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    return [_StepWrap(optimizer, pre, post)]
