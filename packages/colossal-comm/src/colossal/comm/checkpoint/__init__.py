"""colossal.comm.checkpoint: the flat-slice checkpoint format every sharded writer shares (ZeRO,
Gemini, every ``colossalai`` Booster plugin), with its guarantees: an entry table (every entry's
logical shape and dtype) checked strictly before anything loads, checksums verified before any
file is read, and ordinary exceptions naming the file at fault.

It lives here, below the engines, so that ``colossal-zero`` and ``colossal-gemini`` (which may
depend on ``colossal-comm`` only) give their own ``save_sharded`` / ``load_sharded`` the same
guarantees as the Booster. Names load lazily (PEP 562): the errors alone do not import
``torch.distributed.checkpoint`` (a heavy import the engines make only when checkpointing).
"""

import importlib

_HOME = {
    "CHECKSUM_DIR": "integrity",
    "ENTRIES_PREFIX": "entries",
    "GROUPS_KEY": "slices",
    "CheckpointError": "errors",
    "CheckpointMismatchError": "errors",
    "Entry": "entries",
    "FlatShard": "optim_state",
    "ShardState": "optim_state",
    "UNKNOWN": "optim_state",
    "check_full_state": "optim_state",
    "gather_full_state": "optim_state",
    "scatter_full_state": "optim_state",
    "IncompatibleEntries": "errors",
    "SliceReader": "slices",
    "apply_groups": "slices",
    "blob": "flat",
    "check_state_dict": "errors",
    "compare_entries": "entries",
    "entries_blob": "entries",
    "entry_of_key": "entries",
    "fit_entries": "flat",
    "groups_blob": "slices",
    "load_file_checked": "integrity",
    "open_flat": "flat",
    "open_reader": "flat",
    "piece_index": "slices",
    "read_blob": "flat",
    "save_flat": "flat",
    "unreadable": "errors",
    "verify_files": "integrity",
    "write_checksums": "integrity",
    "write_dcp_checksums": "integrity",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
