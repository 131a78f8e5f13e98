"""The flat-slice checkpoint format and its reader: moved to :mod:`colossal.comm.checkpoint.slices`
([Note: flat-slice checkpoints] there), below the engines that write it; this module keeps the
old import path working."""

from colossal.comm.checkpoint.slices import (
    GROUPS_KEY,
    SliceReader,
    aliases,
    apply_groups,
    fill_state,
    groups_blob,
    model_entries,
    pieces_from_state,
)

__all__ = [
    "SliceReader",
    "GROUPS_KEY",
    "pieces_from_state",
    "fill_state",
    "groups_blob",
    "apply_groups",
    "aliases",
    "model_entries",
]
