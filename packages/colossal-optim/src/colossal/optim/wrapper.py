"""``OptimizerWrapper``: the ``torch.optim.Optimizer`` face of an optimizer that wraps another.

[Note: wrappers are optimizers]
ZeRO's ``ZeroOptimizer``, Gemini's ``GeminiOptimizer`` and the Booster's boosted optimizers wrap the
user's ``torch.optim.Optimizer`` (they shard it, scale the loss, clip, skip overflowing steps). Code
written for torch checks ``isinstance(opt, torch.optim.Optimizer)`` (every LR scheduler does) and
reads ``param_groups``, ``defaults`` and ``state``, and registers step hooks. So a wrapper *is* an
``Optimizer``: it does not run ``Optimizer.__init__`` (which would build its own param groups), but
sets up what that constructor sets up besides them (the hook tables, the profiler label of ``step``)
and answers ``param_groups``/``defaults``/``state`` with the wrapped optimizer's own objects, so a
scheduler that writes ``group["lr"]`` changes the learning rate the wrapped rule steps with. Step
hooks registered on the wrapper run around the wrapper's ``step`` (unscale, clip and the shard
refresh included), as torch's do around an optimizer's. Adding param groups after wrapping is
refused: the wrapper has already laid the parameters out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(torch.optim.Optimizer):
    """Base of optimizers that wrap a ``torch.optim.Optimizer`` (see ``[Note: wrappers are optimizers]``).

    A subclass calls :meth:`_wrap` with the wrapped optimizer in its constructor and implements
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` with torch's meaning.
    """

    _wrapped: torch.optim.Optimizer

    def _wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Set up the Optimizer surface around ``optimizer`` (what ``Optimizer.__init__`` sets up except
        the param groups, which stay ``optimizer``'s)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.__dict__["_wrapped"] = optimizer
        for table in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            self.__dict__[table] = OrderedDict()
        self._patch_step_function()  # step hooks + the "Optimizer.step#<class>.step" profiler label

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (the same dicts: writing ``lr`` here changes its ``lr``)."""
        return self.__dict__["_wrapped"].param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyperparameters."""
        return self.__dict__["_wrapped"].defaults

    @property
    def state(self):
        """The wrapped optimizer's per-tensor state (keyed by the tensors it steps: shards for sharding engines)."""
        return self.__dict__["_wrapped"].state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the wrapper has laid out the parameters it was built with."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot add a param group after wrapping; build the wrapped optimizer "
            "with every param group first"
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__['_wrapped']!r})"
