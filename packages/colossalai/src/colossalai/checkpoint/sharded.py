"""Sharded model/optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the shards it owns; names are the original module's parameter names, so a
checkpoint written by one plugin and world size is read by any other (DCP reshards on load).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

__all__ = ["save_sharded", "load_sharded", "MODEL_KEY", "OPTIMIZER_KEY", "DCP_SUBDIR"]

MODEL_KEY = "model"
"""Key of the model state inside a checkpoint."""
OPTIMIZER_KEY = "optimizer"
"""Key of the optimizer state inside a checkpoint."""
DCP_SUBDIR = "dcp"
"""Sub-directory of a checkpoint holding the DCP files."""


def _state(plugin, model: nn.Module, optimizer) -> dict:
    state = {MODEL_KEY: plugin.model_state_dict(model)}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = plugin.optimizer_state_dict(model, optimizer)
    return state


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when torch.distributed is off: that is intended."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(folder: str | os.PathLike, plugin, model: nn.Module, optimizer=None) -> None:
    """Write the model (and optimizer) state of every rank into ``folder/dcp``."""
    with torch.profiler.record_function("colossalai.checkpoint::save_sharded"), _quiet_single_process():
        dcp.save(_state(plugin, model, optimizer), checkpoint_id=str(pathlib.Path(folder) / DCP_SUBDIR))


def load_sharded(folder: str | os.PathLike, plugin, model: nn.Module, optimizer=None) -> None:
    """Read ``folder/dcp`` into the model (and optimizer), resharding to the current layout."""
    path = pathlib.Path(folder) / DCP_SUBDIR
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no DCP checkpoint (missing .metadata)")
    with torch.profiler.record_function("colossalai.checkpoint::load_sharded"), _quiet_single_process():
        state = _state(plugin, model, optimizer)
        dcp.load(state, checkpoint_id=str(path))
        plugin.load_model_state_dict(model, state[MODEL_KEY])
        if optimizer is not None:
            plugin.load_optimizer_state_dict(model, optimizer, state[OPTIMIZER_KEY])
