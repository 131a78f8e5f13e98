"""The non-tensor half of a whole-run checkpoint: step, data position, scheduler, loss scaler,
RNG states (one file per rank) and user extras."""

from __future__ import annotations

import os
import pathlib
import random

import torch
import torch.distributed as dist

from colossalai.checkpoint.errors import CheckpointError
from colossalai.checkpoint.integrity import load_file_checked, write_checksums

__all__ = [
    "capture_rng",
    "restore_rng",
    "save_rng",
    "load_rng",
    "read_rng",
    "load_run_file",
    "save_run_files",
    "RUN_FILE",
]

RUN_FILE = "run_state.pt"
"""File (written by rank 0) holding step, data position, scheduler/scaler states and extras."""


def capture_rng() -> dict:
    """Python, torch CPU and (when present) CUDA generator states of this process."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng` (missing entries are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_rng(folder: str | os.PathLike) -> None:
    """Write this rank's RNG state to ``folder/rng/rank<r>.pt``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = pathlib.Path(folder) / "rng"
    path.mkdir(exist_ok=True)
    torch.save(capture_rng(), path / f"rank{rank}.pt")


def save_run_files(folder: str | os.PathLike, payload: dict | None) -> None:
    """This rank's RNG state and (``payload`` not None: rank 0) the run state, with their checksums
    (``folder/checksums/rank<r>.json``, [Note: checksums])."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    save_rng(folder)
    names = [f"rng/rank{rank}.pt"]
    if payload is not None:
        torch.save(payload, pathlib.Path(folder) / RUN_FILE)
        names.append(RUN_FILE)
    write_checksums(folder, names, rank)


def load_rng(folder: str | os.PathLike) -> None:
    """Restore this rank's RNG state; a rank the saving run did not have takes rank 0's."""
    restore_rng(read_rng(folder))


def read_rng(folder: str | os.PathLike) -> dict:
    """This rank's saved RNG state (rank 0's for a rank the saving run did not have), checked:
    CheckpointError naming the file when it is damaged."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = pathlib.Path(folder) / "rng"
    own = path / f"rank{rank}.pt"
    state = load_file_checked(own if own.exists() else path / "rank0.pt", "the RNG state", _torch_load, folder)
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise CheckpointError(f"{own} is not an RNG state file (no 'torch'/'python' entries)", own)
    return state


def _torch_load(path):
    return torch.load(path, weights_only=False)


def load_run_file(folder: str | os.PathLike) -> dict:
    """The ``run_state.pt`` of a run checkpoint; CheckpointError naming it when it is damaged."""
    path = pathlib.Path(folder) / RUN_FILE
    payload = load_file_checked(path, "the run state", _torch_load, folder)
    if not isinstance(payload, dict) or "run" not in payload:
        raise CheckpointError(f"{path} is not a run state file (no 'run' entry)", path)
    return payload
