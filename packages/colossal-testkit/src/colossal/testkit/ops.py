"""Counting the operators a block of code dispatches: the host cost of an engine, measured directly.

On a GPU a training step is host-bound when Python dispatches more operators than the kernels take
time to run; on a CPU-only machine the count is the part of that cost that does not depend on the
hardware. :class:`OpCounter` counts every ATen operator dispatched inside it (views and in-place
ones included, as the dispatcher sees them), by name.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter"]


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: step()`` then ``ops.total`` and ``ops.count["view"]``.

    ``count`` is keyed by the operator's overload packet name (``"view"``, ``"add_"``,
    ``"_foreach_norm"``, ``"allreduce_"``); a foreach operator counts once, as it dispatches once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()
        """Operators dispatched so far, by name."""

    @property
    def total(self) -> int:
        """All operators dispatched so far."""
        return sum(self.count.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
