"""The entry table of a checkpoint: every entry's logical shape and dtype, and the strict check.

[Note: strict loading]
A flat-slice checkpoint stores 1-D pieces, so the pieces alone tell a tensor's element count, not
its shape: a (4, 6) parameter would load into a (6, 4) one. Each saving rank therefore adds the
table ``extra/entries/rank<r>`` (JSON in a uint8 tensor): ``{"model/<name>": [shape, dtype], ...,
"optim/<name>/<key>": [shape, dtype]}`` for every entry it knows. A load reads the tables of all
saving ranks (their union), compares them with what the model and optimizer expect
(:meth:`Plugin.checkpoint_entries`) and raises one :class:`CheckpointMismatchError` listing every
missing, unexpected and mis-shaped entry, on every rank alike (the inputs are the same on every
rank), before anything is read into the model. Like ``torch.nn.Module.load_state_dict``:

* ``strict=False`` skips missing and unexpected entries and returns them; a mis-shaped entry is
  always an error (torch raises for a size mismatch even when not strict);
* dtypes are checked by kind (floating, complex, integer, bool): an fp32 checkpoint loads into a
  bf16 model (mixed-precision engines save fp32 masters), an int64 counter does not load into a
  float tensor;
* optimizer state may be absent for some parameters (torch's optimizers hold none for a parameter
  that never had a gradient); what is present must belong to a parameter and have its shape.

A checkpoint written before the table existed is checked by element counts only.
"""

from __future__ import annotations

import json

import torch

from colossal.comm.checkpoint.errors import IncompatibleEntries

__all__ = ["ENTRIES_PREFIX", "entries_blob", "entry_of_key", "dtype_kind", "compare_entries", "Entry"]

ENTRIES_PREFIX = "extra/entries/rank"
"""Key prefix of the per-rank entry tables."""

Entry = tuple[tuple[int, ...] | None, str | None]
"""``(logical shape, dtype name)``; None where unknown (a checkpoint without a table)."""


def entry_of_key(key: str) -> str:
    """``model/w@12`` -> ``model/w``; other keys as they are."""
    head, _, start = key.rpartition("@")
    return head if head and start.isdigit() else key


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_kind(name: str | None) -> str | None:
    if name is None:
        return None
    dtype = getattr(torch, name)
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "bool" if dtype is torch.bool else "integer"


def _describe(entry: Entry) -> str:
    shape, dtype = entry
    return f"{tuple(shape) if shape is not None else '?'} {dtype or '?'}"


def entries_blob(model_entries: dict[str, Entry], pieces: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's table: ``model_entries`` plus one entry per optimizer state among ``pieces``
    (a per-element state has its parameter's shape; a scalar state its own)."""
    table = {k: [list(s), d] for k, (s, d) in model_entries.items()}
    for key, t in pieces.items():
        entry = entry_of_key(key)
        if not entry.startswith("optim/") or entry in table or not isinstance(t, torch.Tensor):
            continue
        name = entry[len("optim/") :].rsplit("/", 1)[0]
        per_element = entry != key
        shape = model_entries[f"model/{name}"][0] if per_element and f"model/{name}" in model_entries else t.shape
        table[entry] = [list(shape), dtype_name(t.dtype)]
    return torch.frombuffer(bytearray(json.dumps(table, sort_keys=True).encode()), dtype=torch.uint8)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _mismatch(saved: Entry, expected: Entry, held: int | None) -> bool:
    (s_shape, s_dtype), (e_shape, e_dtype) = saved, expected
    if s_shape is not None and tuple(s_shape) != tuple(e_shape):
        return True
    if s_shape is None and held is not None and held != _numel(e_shape):
        return True
    kinds = dtype_kind(s_dtype), dtype_kind(e_dtype)
    return None not in kinds and kinds[0] != kinds[1]


def compare_entries(
    saved: dict[str, Entry], held: dict[str, int], expected: dict[str, Entry], with_optimizer: bool
) -> IncompatibleEntries:
    """Missing, unexpected and mis-shaped entries (note above). ``saved``: the checkpoint's table;
    ``held``: elements stored per entry; ``expected``: the model's ``model/<name>`` entries."""
    model_saved = {k for k in saved if k.startswith("model/")}
    missing = sorted(set(expected) - model_saved)
    unexpected = sorted(model_saved - set(expected))
    mismatched = []
    for key in sorted(model_saved & set(expected)):
        if _mismatch(saved[key], expected[key], held.get(key)):
            mismatched.append(f"{key}: checkpoint {_describe(saved[key])}, model {_describe(expected[key])}")
    if with_optimizer:
        for key in sorted(k for k in saved if k.startswith("optim/")):
            param = "model/" + key[len("optim/") :].rsplit("/", 1)[0]
            if param not in expected:
                unexpected.append(key)
                continue
            shape, _ = saved[key]
            per_element = shape is None or len(shape) > 0
            if per_element and _mismatch((shape, None), (expected[param][0], None), held.get(key)):
                mismatched.append(f"{key}: checkpoint {_describe(saved[key])}, parameter {_describe(expected[param])}")
    return IncompatibleEntries(missing, unexpected, mismatched)
