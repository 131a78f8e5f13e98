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

from colossalai.checkpoint.entries import ENTRIES_PREFIX, compare_entries, entries_blob
from colossalai.checkpoint.errors import CheckpointError, CheckpointMismatchError, IncompatibleEntries
from colossalai.checkpoint.integrity import write_dcp_checksums
from colossalai.checkpoint.slices import SliceReader

__all__ = ["save_sharded", "load_sharded", "check_fits", "DCP_SUBDIR"]

DCP_SUBDIR = "dcp"
"""Sub-directory of a checkpoint holding the DCP files."""


@contextlib.contextmanager
def _quiet_single_process():
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
    with torch.profiler.record_function("colossalai.checkpoint::save_sharded"), _quiet_single_process():
        pieces = plugin.checkpoint_pieces(model, optimizer)
        pieces[f"{ENTRIES_PREFIX}{_rank()}"] = entries_blob(plugin.checkpoint_entries(model), pieces)
        dcp.save(pieces, checkpoint_id=str(path))
        write_dcp_checksums(path, _rank())


def check_fits(reader: SliceReader, plugin, model: nn.Module, optimizer=None, *, strict: bool = True):
    """The strict check ([Note: strict loading]): raise :class:`CheckpointMismatchError` listing
    every missing, unexpected and mis-shaped entry (only mis-shaped ones when not ``strict``);
    otherwise return them, and mark the missing ones to be left alone (``reader.skip``)."""
    reader.check()
    if optimizer is not None:
        reader.groups()  # a model-only checkpoint: an error before anything is read
    expected = plugin.checkpoint_entries(model)
    found = compare_entries(reader.entries(), reader.held(), expected, optimizer is not None)
    if found.mismatched or (strict and found):
        hint = "" if found.mismatched else "pass strict=False to load the entries that match and get these lists back"
        raise CheckpointMismatchError(reader.path, found, hint)
    reader.skip = set(found.missing)
    return found


def load_sharded(
    folder: str | os.PathLike, plugin, model: nn.Module, optimizer=None, *, strict: bool = True
) -> IncompatibleEntries:
    """Read ``folder/dcp`` into the model (and optimizer), resharding to the current layout, after
    the strict check (:func:`check_fits`); returns the entries a non-strict load skipped. Collective."""
    path = pathlib.Path(folder) / DCP_SUBDIR
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} holds no DCP checkpoint (missing .metadata): the checkpoint is incomplete or not one", path
        )
    with torch.profiler.record_function("colossalai.checkpoint::load_sharded"), _quiet_single_process():
        reader = SliceReader(path)
        if not any(k.startswith("model/") for k in reader.metadata):
            raise CheckpointError(f"{path} is not a flat-slice checkpoint (no 'model/<name>' entries)", path)
        found = check_fits(reader, plugin, model, optimizer, strict=strict)
        plugin.load_checkpoint_pieces(model, optimizer, reader)
    return found
