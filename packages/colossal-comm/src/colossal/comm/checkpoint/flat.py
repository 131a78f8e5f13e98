"""Write and open a flat-slice checkpoint with its guarantees: the entry table, checksums, and the
strict check before anything is read ([Note: strict loading] in :mod:`.entries`, [Note:
checksums] in :mod:`.integrity`). The engines' own ``save_sharded`` / ``load_sharded`` and the
``colossalai`` Booster all go through these two steps."""

from __future__ import annotations

import os
import pathlib

import torch
import torch.distributed.checkpoint as dcp

from colossal.comm.checkpoint.entries import ENTRIES_PREFIX, Entry, compare_entries, entries_blob
from colossal.comm.checkpoint.errors import CheckpointError, CheckpointMismatchError, IncompatibleEntries
from colossal.comm.checkpoint.integrity import write_dcp_checksums
from colossal.comm.checkpoint.slices import SliceReader

__all__ = ["save_flat", "open_reader", "open_flat", "fit_entries", "read_blob", "blob"]


def save_flat(path: str | os.PathLike, pieces: dict, entries: dict[str, Entry], rank: int, **dcp_kwargs) -> None:
    """``dcp.save`` this rank's ``pieces`` into ``path`` with its entry table (``entries``: the
    ``model/<name>`` entries it knows) and the checksums of the files it wrote. ``rank``: this
    rank's index in the saving group (DCP names its files by it). Collective over that group."""
    pieces = dict(pieces)
    pieces[f"{ENTRIES_PREFIX}{rank}"] = entries_blob(entries, pieces)
    dcp.save(pieces, checkpoint_id=str(path), **dcp_kwargs)
    write_dcp_checksums(path, rank)


def fit_entries(
    reader: SliceReader, expected: dict[str, Entry], *, with_optimizer: bool, strict: bool = True
) -> IncompatibleEntries:
    """The strict check: raise :class:`CheckpointMismatchError` listing every missing, unexpected
    and mis-shaped entry (only mis-shaped ones when not ``strict``); otherwise return them and mark
    the missing ones to be left alone (``reader.skip``). The same decision on every rank."""
    reader.check()
    found = compare_entries(reader.entries(), reader.held(), expected, with_optimizer)
    if found.mismatched or (strict and found):
        hint = "" if found.mismatched else "pass strict=False to load the entries that match and get these lists back"
        raise CheckpointMismatchError(reader.path, found, hint)
    reader.skip = set(found.missing)
    return found


def open_reader(path: str | os.PathLike, **dcp_kwargs) -> SliceReader:
    """A :class:`SliceReader` of the flat-slice checkpoint ``path`` (its ``.metadata`` verified);
    :class:`CheckpointError` naming ``path`` when it is none."""
    if not (pathlib.Path(path) / ".metadata").is_file():
        raise CheckpointError(
            f"{str(path)!r} holds no DCP checkpoint (missing .metadata): the checkpoint is incomplete or not one", path
        )
    reader = SliceReader(path, **dcp_kwargs)
    if not any(k.startswith("model/") for k in reader.metadata):
        raise CheckpointError(f"{str(path)!r} is not a flat-slice checkpoint (no 'model/<name>' entries)", path)
    return reader


def open_flat(
    path: str | os.PathLike, expected: dict[str, Entry], *, with_optimizer: bool, strict: bool = True, **dcp_kwargs
) -> tuple[SliceReader, IncompatibleEntries]:
    """:func:`open_reader` then :func:`fit_entries` against ``expected`` (``model/<name> -> (shape,
    dtype)``); returns the reader (``reader.load`` verifies every file before DCP reads it) and
    what a non-strict load skips. Collective (the entry tables are read with one ``dcp.load``)."""
    reader = open_reader(path, **dcp_kwargs)
    return reader, fit_entries(reader, expected, with_optimizer=with_optimizer, strict=strict)


def read_blob(reader: SliceReader, key: str) -> bytes:
    """The bytes of a uint8 blob entry (pickled hyperparameters) of the checkpoint."""
    if key not in reader.metadata:
        raise CheckpointError(f"{reader.path!r} has no entry {key!r}: it was not written by this engine", reader.path)
    return reader.read([key])[key].numpy().tobytes()


def blob(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor entry."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
