"""What :mod:`colossal.zero.checkpoint` needs of an engine: a structural type, so that the
checkpoint module does not import :mod:`colossal.zero.optimizer` (which imports it); the engine
satisfies it without naming it."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from colossal.zero._flat_param import FlatParam
from colossal.zero.config import ZeroConfig

__all__ = ["ZeroState"]


class ZeroState(Protocol):
    """The state-holding side of :class:`~colossal.zero.ZeroOptimizer` (its flat buffers, the
    wrapped module and optimizer, the loss scaler) and the accessors of optimizer state per buffer."""

    flats: list[FlatParam]
    module: nn.Module
    optimizer: torch.optim.Optimizer
    config: ZeroConfig
    device: torch.device
    scaler: object
    _orig_groups: list[list[nn.Parameter]]

    def _flat_state(self, flat: FlatParam) -> dict: ...

    def _param_states(self, flat: FlatParam) -> list[dict | None]: ...

    def _set_param_states(self, flat: FlatParam, state: dict, scalars: list[dict | None]) -> None: ...

    def _publish_params(self) -> None: ...
