"""Shared checkpoint-guarantee fixtures: a model family with missing and mis-shaped entries, the
mismatch lines they must produce, file damage (a flipped byte, a truncation), and the rank functions
that run the cases for any engine (given its save, load and state functions)."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "guarantee_model",
    "MISMATCH_LINES",
    "MISSING",
    "damage_file",
    "call_on_rank0_only",
    "guarantee_case",
]

MISSING = ["model/3.bias", "model/3.weight"]
"""What ``guarantee_model(extra=True)`` has and ``guarantee_model()``'s checkpoint lacks."""

MISMATCH_LINES = (
    "2 missing: model/3.bias, model/3.weight",
    "model/0.weight: checkpoint (6, 4) float32, model (4, 6) float32",
    "model/0.bias: checkpoint (6,) float32, model (4,) float32",
)
"""Lines a strict load of ``guarantee_model()``'s checkpoint into
``guarantee_model(extra=True, transposed=True)`` must print (shapes included)."""


def guarantee_model(seed: int, extra: bool = False, transposed: bool = False) -> nn.Module:
    """``Linear(4, 6) - ReLU - Linear(6, 4)``; ``transposed``: the first layer is ``Linear(6, 4)``
    (weight (4, 6) against (6, 4): the same element count, another shape); ``extra``: a fourth
    layer ``Linear(4, 2)`` (entries the checkpoint lacks)."""
    torch.manual_seed(seed)
    first = nn.Linear(6, 4) if transposed else nn.Linear(4, 6)
    layers = [first, nn.ReLU(), nn.Linear(4 if transposed else 6, 4)]
    return nn.Sequential(*layers, *([nn.Linear(4, 2)] if extra else []))


def damage_file(path: str | pathlib.Path, how: str) -> None:
    """``how="flip"``: invert the byte in the middle of ``path``; ``"truncate"``: cut it in half."""
    path = pathlib.Path(path)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    else:
        raise ValueError(f"how must be 'flip' or 'truncate', got {how!r}")
    path.write_bytes(bytes(data))


def call_on_rank0_only(cases: dict[str, Callable[[], object]], catch_up: Callable[[str], None]) -> dict:
    """Call each of ``cases`` (``name -> call``) on rank 0 alone, the ``if rank == 0:`` mistake;
    rank 1 waits, then ``catch_up(name)`` (as if it called it late) so the next case starts in step.
    Returns, on rank 0, ``name -> (seconds, the exception raised or None)``."""
    out = {}
    for name, call in cases.items():
        if dist.get_rank() == 0:
            start, raised = time.perf_counter(), None
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - returned to the test, which checks its type
                raised = exc
            out[name] = (time.perf_counter() - start, raised)
        dist.barrier()
        if dist.get_rank() == 1:
            catch_up(name)
    return out


def guarantee_case(case: str, root: str, *, build: Callable, save: Callable, load: Callable, state: Callable) -> dict:
    """One checkpoint-guarantee case on every rank. ``build(model)`` returns a trained engine,
    ``save(engine, root)``, ``load(engine, root, strict)`` returns what it skipped, ``state(engine)``
    the full model state. Cases: ``"strict"`` (load into the transposed model with an extra layer:
    returns the error and whether the state stayed unchanged), ``"lenient"`` (``strict=False`` into
    the model with an extra layer: what was skipped, whether the rest loaded and the extra layer
    kept its values), ``"flip"`` / ``"truncate"`` (damage rank 1's first shard: the error)."""
    engine = build(guarantee_model(0))
    save(engine, root)
    saved = state(engine)
    if case in ("flip", "truncate"):
        dist.barrier()
        if dist.get_rank() == 0:  # after every rank saved
            damage_file(sorted(pathlib.Path(root).glob("__1_*.distcp"))[0], case)
        dist.barrier()
    other = build(guarantee_model(1, extra=case != "flip" and case != "truncate", transposed=case == "strict"))
    before = state(other)
    try:
        found, raised = load(other, root, case != "lenient"), None
    except Exception as exc:  # noqa: BLE001 - returned to the test, which checks its type
        found, raised = None, exc
    after = state(other)
    return {
        "error": raised,
        "unchanged": all(torch.equal(before[k], v) for k, v in after.items()),
        "found": None if found is None else tuple(found),
        "loaded": all(torch.equal(after[k], saved[k]) for k in saved if k in after),
        "kept": "3.weight" in after and torch.equal(after["3.weight"], before["3.weight"]),
    }
