"""The entry table of a checkpoint and the strict check: moved to
:mod:`colossal.comm.checkpoint.entries` ([Note: strict loading] there); this module keeps the old
import path working."""

from colossal.comm.checkpoint.entries import (
    ENTRIES_PREFIX,
    Entry,
    compare_entries,
    dtype_kind,
    dtype_name,
    entries_blob,
    entry_of_key,
)

__all__ = ["ENTRIES_PREFIX", "entries_blob", "entry_of_key", "dtype_kind", "dtype_name", "compare_entries", "Entry"]
