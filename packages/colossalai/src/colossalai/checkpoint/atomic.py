"""Crash-safe checkpoint directories: write into a hidden partial directory, rename when complete.

[Note: atomic checkpoints]
A checkpoint ``<root>/<name>`` is first written as ``<root>/.<name>.partial``. Only when every rank
has finished (barrier) does rank 0 rename it into place (``os.replace`` of a directory is atomic on
POSIX within one file system) and then rewrite ``<root>/latest`` (itself through a temporary file
and ``os.replace``). A crash at any moment therefore leaves either the old ``latest`` pointing at
a complete older checkpoint, or the new one complete; stale ``.partial`` directories are removed by
the next save (one save at a time per root). The root must be on a file system every rank sees
(one host, or a shared mount).

Saving again under an existing name cannot swap two directories in one POSIX rename: the old one
is first renamed to ``<root>/.<name>.old``, then the new one into place. A crash between the two
renames leaves ``latest`` naming a missing directory next to its complete ``.old``:
:func:`read_latest` then returns the ``.old`` directory, and the next save renames it back before
it starts (``_recover``). ``tests/test_colossalai_checkpoint_crash.py`` kills a saving process with
SIGKILL at each of these points and loads what is left.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil

import torch.distributed as dist

__all__ = ["atomic_checkpoint_dir", "resolve_checkpoint", "read_latest", "LATEST"]

LATEST = "latest"
"""Name of the pointer file (holds the directory name of the newest complete checkpoint)."""


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _old(final: pathlib.Path) -> pathlib.Path:
    """Where a published checkpoint waits while a new one of the same name replaces it."""
    return final.with_name(f".{final.name}.old")


def _recover(root: pathlib.Path) -> None:
    """Undo what an interrupted save left (rank 0): drop partial directories, put back an old
    checkpoint whose replacement never arrived, drop one whose replacement did."""
    for stale in root.glob(".*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in root.glob(".*.old"):
        final = root / old.name[1 : -len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def _commit(partial: pathlib.Path, final: pathlib.Path) -> None:
    """Move a complete checkpoint into place and point ``latest`` at it (rank 0 only)."""
    if final.exists():
        trash = _old(final)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)  # a crash from here to the next line: see the module note
        os.replace(partial, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(partial, final)
    tmp = final.parent / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, final.parent / LATEST)


@contextlib.contextmanager
def atomic_checkpoint_dir(root: str | os.PathLike, name: str):
    """Yield a fresh partial directory to write into; publish it as ``root/name`` on success.

    Every rank must enter; on an exception nothing is published (and the previous ``latest``
    stays valid).
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"checkpoint name must be a plain directory name, got {name!r}")
    root = pathlib.Path(root)
    partial = root / f".{name}.partial"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)  # what an interrupted save left
        partial.mkdir()
    _barrier()
    yield partial
    _barrier()
    if _rank() == 0:
        _commit(partial, root / name)
    _barrier()


def read_latest(root: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint under ``root`` (via ``latest``), or None. When a save under
    the same name was interrupted mid-swap, that is the ``.old`` directory (module note)."""
    pointer = pathlib.Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = pathlib.Path(root) / pointer.read_text().strip()
    for candidate in (path, _old(path)):
        if candidate.is_dir():
            return candidate
    return None


def resolve_checkpoint(path: str | os.PathLike) -> pathlib.Path:
    """``path`` itself when it is a checkpoint, or the ``latest`` one when it is a checkpoint root."""
    path = pathlib.Path(path)
    if (path / LATEST).is_file():
        latest = read_latest(path)
        if latest is None:
            raise FileNotFoundError(f"{path / LATEST} points at a checkpoint that does not exist")
        return latest
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (neither a checkpoint nor a root with '{LATEST}')")
    return path
