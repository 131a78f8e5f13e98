"""Sharded model/optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the pieces it holds and reads only the pieces overlapping what it holds, in
the flat-slice format of :mod:`colossalai.checkpoint.slices` (names are the original module's
parameter names), so a checkpoint written by one plugin and world size is read by any other.
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

from colossalai.checkpoint.slices import SliceReader

__all__ = ["save_sharded", "load_sharded", "DCP_SUBDIR"]

DCP_SUBDIR = "dcp"
"""Sub-directory of a checkpoint holding the DCP files."""


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
        dcp.save(plugin.checkpoint_pieces(model, optimizer), checkpoint_id=str(pathlib.Path(folder) / DCP_SUBDIR))


def load_sharded(folder: str | os.PathLike, plugin, model: nn.Module, optimizer=None) -> None:
    """Read ``folder/dcp`` into the model (and optimizer), resharding to the current layout."""
    path = pathlib.Path(folder) / DCP_SUBDIR
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no DCP checkpoint (missing .metadata)")
    with torch.profiler.record_function("colossalai.checkpoint::load_sharded"), _quiet_single_process():
        reader = SliceReader(path)
        if not any(k.startswith("model/") for k in reader.pieces):
            raise ValueError(f"{path} is not a flat-slice checkpoint (no 'model/<name>@<start>' pieces)")
        reader.check(n for n, _ in plugin.unwrap(model).named_parameters())  # first names of tied ones
        plugin.load_checkpoint_pieces(model, optimizer, reader)
