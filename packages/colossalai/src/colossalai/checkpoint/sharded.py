"""Sharded model/optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the pieces it holds and reads only the pieces overlapping what it holds, in
the flat-slice format of :mod:`colossal.comm.checkpoint.slices` (names are the original module's
parameter names), so a checkpoint written by one plugin and world size is read by any other.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from colossal.comm.checkpoint import IncompatibleEntries, SliceReader, fit_entries, open_reader, save_flat

__all__ = ["save_sharded", "load_sharded", "open_checkpoint", "check_fits", "quiet_single_process", "DCP_SUBDIR"]

DCP_SUBDIR = "dcp"
"""Sub-directory of a checkpoint holding the DCP files."""


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process when torch.distributed is off: that is intended."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_sharded(folder: str | os.PathLike, plugin, model: nn.Module, optimizer=None) -> None:
    """Write the model (and optimizer) state of every rank into ``folder/dcp``, with the entry table
    ([Note: strict loading]) and the checksums of the files ([Note: checksums]). Collective: every
    rank calls it."""
    path = pathlib.Path(folder) / DCP_SUBDIR
    with torch.profiler.record_function("colossalai.checkpoint::save_sharded"), quiet_single_process():
        pieces = plugin.checkpoint_pieces(model, optimizer)
        save_flat(path, pieces, plugin.checkpoint_entries(model), _rank())


def check_fits(reader: SliceReader, plugin, model: nn.Module, optimizer=None, *, strict: bool = True):
    """The strict check ([Note: strict loading]): raise :class:`CheckpointMismatchError` listing
    every missing, unexpected and mis-shaped entry (only mis-shaped ones when not ``strict``);
    otherwise return them, and mark the missing ones to be left alone (``reader.skip``)."""
    if optimizer is not None:
        reader.groups()  # a model-only checkpoint: an error before anything is read
    return fit_entries(reader, plugin.checkpoint_entries(model), with_optimizer=optimizer is not None, strict=strict)


def open_checkpoint(folder: str | os.PathLike) -> SliceReader:
    """The :class:`SliceReader` of ``folder/dcp`` (or of ``folder`` itself, an engine's own
    ``save_sharded``); :class:`CheckpointError` naming it when it holds none."""
    path = pathlib.Path(folder) / DCP_SUBDIR
    if not path.is_dir() and (pathlib.Path(folder) / ".metadata").is_file():  # an engine's own save_sharded
        path = pathlib.Path(folder)
    return open_reader(path)


def load_sharded(
    folder: str | os.PathLike, plugin, model: nn.Module, optimizer=None, *, strict: bool = True, reader=None
) -> IncompatibleEntries:
    """Read ``folder/dcp`` into the model (and optimizer), resharding to the current layout, after
    the strict check (:func:`check_fits`); returns the entries a non-strict load skipped. ``reader``:
    the folder's :func:`open_checkpoint` when the caller opened it already. Collective."""
    with torch.profiler.record_function("colossalai.checkpoint::load_sharded"), quiet_single_process():
        reader = reader if reader is not None else open_checkpoint(folder)
        found = check_fits(reader, plugin, model, optimizer, strict=strict)
        plugin.load_checkpoint_pieces(model, optimizer, reader)
    return found
