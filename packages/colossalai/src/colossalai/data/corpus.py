"""The embedded default corpus: the Python standard library's own source, as bytes.

Every Python installation carries a few megabytes of well-formed, varied text (code, docstrings,
comments) in ``sysconfig.get_paths()["stdlib"]``. Read in sorted path order and tokenised at
byte level (vocabulary 256), it is a corpus that needs no download and no tokenizer, and is the
same on every machine with the same Python version.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
from collections.abc import Iterator

import torch

__all__ = ["stdlib_files", "load_corpus", "read_text_corpus", "encode", "decode", "VOCAB_SIZE"]

VOCAB_SIZE = 256
"""Byte-level vocabulary: token id == byte value."""

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
_SKIP_PREFIXES = ("_sysconfigdata",)
"""Generated modules: ``_sysconfigdata_<abi>_<platform>.py`` is one dict of this build's compiler
flags and paths (36 KB of it on Linux), not code, and differs from build to build."""


def stdlib_files(root: str | pathlib.Path | None = None) -> Iterator[pathlib.Path]:
    """The ``.py`` files of the standard library (tests, third-party packages and the generated
    build configuration excluded), in a fixed order: a top-down walk with directory and file names
    sorted. Lazy, so that reading a prefix of the corpus never lists the whole tree."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"standard library directory {str(root)!r} does not exist")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith(_SKIP_PREFIXES):
                yield pathlib.Path(dirpath, name)


def load_corpus(max_bytes: int = 4_000_000, root: str | pathlib.Path | None = None) -> torch.Tensor:
    """Concatenate standard-library sources (file order sorted) up to ``max_bytes``; returns uint8 (N,)."""
    if max_bytes <= 1:
        raise ValueError(f"max_bytes must be > 1, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_files(root):
        data = path.read_bytes() + b"\n\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def _text_files(root: pathlib.Path) -> Iterator[pathlib.Path]:
    """Files under ``root`` in a fixed order (a sorted top-down walk), hidden ones left out."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield pathlib.Path(dirpath, name)


def read_text_corpus(path: str | pathlib.Path, max_bytes: int) -> torch.Tensor:
    """A user's corpus as uint8 (N,): the bytes of the text file ``path``, or of every UTF-8 text
    file under the folder ``path`` (sorted walk; hidden files and files that are not UTF-8, such as
    images or archives, are left out), each followed by a blank line, up to ``max_bytes``.
    ValueError naming the path when it holds no text."""
    path = pathlib.Path(path)
    if max_bytes <= 1:
        raise ValueError(f"max_bytes must be > 1, got {max_bytes}")
    if not path.exists():
        raise ValueError(f"corpus {str(path)!r} does not exist (a text file or a folder of text files)")
    chunks, total, skipped = [], 0, 0
    for file in [path] if path.is_file() else _text_files(path):
        data = file.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        chunks.append((data + b"\n\n")[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total <= 1:
        extra = f" ({skipped} file(s) that are not UTF-8 text left out)" if skipped else ""
        raise ValueError(f"corpus {str(path)!r} holds no text{extra}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a long tensor (N,)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Token ids (N,) back to text: the UTF-8 that :func:`encode` and the corpus files use.

    A byte-level model may emit any byte, and a sample cut at a fixed length may end inside a
    character; a byte that is not part of valid UTF-8 is kept, as a ``\\xNN`` escape (Python's
    own spelling), rather than lost to U+FFFD.
    """
    return bytes(tokens.flatten().tolist()).decode("utf-8", errors="backslashreplace")
