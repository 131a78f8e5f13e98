"""Hooks that do not keep their engine alive.

[Note: weak hooks]
``Tensor.register_post_accumulate_grad_hook`` keeps the hook in C++, where Python's cycle collector
cannot see it (torch's tensor traverse does not walk the autograd graph). A hook that is a bound
method of an engine, or a closure over the engine's buffers, closes a cycle the collector cannot
break: parameter -> C++ hook -> engine -> model -> parameter. The engine, its model and every buffer
it holds (Gemini's chunks, ZeRO's gradient buckets) then outlive the user's last reference: a sweep
that builds one engine per trial grows without bound. A hook made by :func:`weak_hook` holds only a
weak reference to the method's object and plain values (indices) as its leading arguments, so
dropping the engine frees it; the hook left on a surviving parameter does nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

__all__ = ["weak_hook"]


def weak_hook(method: Callable, *args) -> Callable:
    """A hook calling the bound ``method`` as ``method(*args, *hook_args)`` through a weak reference to
    its object (a no-op once the object is gone): ``[Note: weak hooks]``. ``args`` are held strongly:
    pass indices, not the engine's tensors."""
    if getattr(method, "__self__", None) is None:
        raise TypeError(f"weak_hook needs a bound method, got {method!r}")
    ref = weakref.WeakMethod(method)

    def hook(*hook_args):
        bound = ref()
        if bound is not None:
            return bound(*args, *hook_args)
        return None

    return hook
