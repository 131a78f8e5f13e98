"""Corruption checks: every checkpoint file is verified before it is used.

[Note: checksums]
``torch.distributed.checkpoint`` stores raw tensor bytes with no checksum: a flipped byte in a
``.distcp`` shard loads silently as a wrong value, and a truncated one surfaces as DCP's
``CheckpointException`` (a ``BaseException`` that ``except Exception`` misses). So after a save,
each rank records the CRC-32 and size of the DCP files it wrote (``__<rank>_<n>.distcp``; rank 0
also ``.metadata``) in ``dcp/checksums/rank<r>.json``, and a load verifies, before DCP reads
anything, exactly the files holding the pieces this rank asks for (from the metadata's storage
index): a rank re-reads only what DCP then reads again from the page cache. Small pickled files
(run state, RNG states) and safetensors shards are checked by loading them inside
:func:`load_file_checked`, which turns any failure into a :class:`CheckpointError` naming the file.
A checkpoint written before checksums existed (no ``checksums`` folder) is still size-checked.
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib
from collections.abc import Callable, Iterable

from colossal.comm.checkpoint.errors import CheckpointError, unreadable

__all__ = ["write_checksums", "write_dcp_checksums", "verify_files", "load_file_checked", "CHECKSUM_DIR"]

CHECKSUM_DIR = "checksums"
"""Folder (inside the DCP directory) of the per-rank checksum files."""

_BLOCK = 1 << 22


def _crc(path: pathlib.Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def write_checksums(folder: str | os.PathLike, names: Iterable[str], rank: int) -> None:
    """Record size and CRC-32 of the files ``names`` (relative to ``folder``) that ``rank`` wrote,
    in ``folder/checksums/rank<r>.json``."""
    folder = pathlib.Path(folder)
    table = {n: {"size": (folder / n).stat().st_size, "crc32": _crc(folder / n)} for n in names}
    (folder / CHECKSUM_DIR).mkdir(exist_ok=True)
    tmp = folder / CHECKSUM_DIR / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(table, sort_keys=True))
    os.replace(tmp, folder / CHECKSUM_DIR / f"rank{rank}.json")


def write_dcp_checksums(dcp_dir: str | os.PathLike, rank: int) -> None:
    """Record the DCP files ``rank`` wrote (``__<rank>_<n>.distcp``; rank 0 also ``.metadata``)."""
    names = sorted(p.name for p in pathlib.Path(dcp_dir).glob(f"__{rank}_*.distcp"))
    write_checksums(dcp_dir, names + [".metadata"] if rank == 0 else names, rank)


def _recorded(dcp_dir: pathlib.Path) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for f in sorted((dcp_dir / CHECKSUM_DIR).glob("rank*.json")):
        try:
            table.update(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            raise unreadable(f, "the checksum file", e) from e
    return table


def verify_files(dcp_dir: str | os.PathLike, names: Iterable[str], min_sizes: dict[str, int] | None = None) -> None:
    """CheckpointError naming the first of ``names`` (files of ``dcp_dir``) that is missing, shorter
    than ``min_sizes`` says (the end of its last piece), or whose size or CRC-32 differs from the
    recorded ones."""
    dcp_dir = pathlib.Path(dcp_dir)
    recorded = _recorded(dcp_dir)
    for name in sorted(set(names)):
        path = dcp_dir / name
        if not path.is_file():
            raise CheckpointError(f"the checkpoint file {str(path)!r} is missing: the checkpoint is incomplete", path)
        size = path.stat().st_size
        need = (min_sizes or {}).get(name, 0)
        rec = recorded.get(name)
        if size < need or (rec is not None and size != rec["size"]):
            expected = rec["size"] if rec is not None else f">= {need}"
            raise unreadable(path, "the checkpoint file", EOFError(f"{size} bytes, expected {expected}"))
        if rec is not None and _crc(path) != rec["crc32"]:
            raise unreadable(path, "the checkpoint file", ValueError("its CRC-32 differs from the one saved"))


def load_file_checked(path: str | os.PathLike, what: str, load: Callable, root: str | os.PathLike | None = None):
    """``load(path)``, with any failure to read or decode it raised as a :class:`CheckpointError`
    naming ``path`` (``what`` says which kind of file it is); first verified against the checksums
    recorded under ``root`` (the folder ``path`` is relative to), when given."""
    if not pathlib.Path(path).is_file():
        raise CheckpointError(f"{what} {str(path)!r} is missing: the checkpoint is incomplete", path)
    if root is not None:
        verify_files(root, [pathlib.Path(path).relative_to(root).as_posix()])
    try:
        return load(path)
    except CheckpointError:
        raise
    except Exception as e:  # EOFError, UnpicklingError, RuntimeError of torch.load, SafetensorError, ...
        raise unreadable(path, what, e) from e
