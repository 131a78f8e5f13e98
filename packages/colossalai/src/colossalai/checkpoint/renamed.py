"""A checkpoint reader shown under other entry names (a base model's checkpoint read into the same
model wrapped by ``peft``, whose names differ).

[Note: a renamed reader]
Every plugin loads through the :class:`~colossalai.checkpoint.SliceReader` interface: ``metadata``
and ``pieces`` keyed ``model/<name>@<start>``, ``load`` of some keys, ``overlapping``, ``assemble``,
``scalar_key``, ``read_box`` and ``skip`` ([Note: flat-slice checkpoints]). :class:`RenamedReader`
offers another reader's entries under new names by renaming the keys of its pieces, and hands each
``load`` back to the inner reader under the old keys, so a DCP checkpoint stays one collective
``dcp.load`` per call and a safetensors folder one ``get_slice`` per run of pieces. Several new
names may show one old entry: the inner reader fills the first tensor and the others are copies
(``peft``'s ``modules_to_save`` keeps a trained copy of a base module, initialised from it).
"""

from __future__ import annotations

from colossalai.checkpoint.slices import SliceReader

__all__ = ["RenamedReader"]


class RenamedReader:
    """``inner``'s entries under new names: ``names`` maps a new entry (``model/<new>``) to the
    inner one it shows (``model/<old>``); inner entries that no new name shows keep their own names
    (a strict load reports them unexpected). ``read_keys`` / ``read_numel`` count the inner reads."""

    def __init__(self, inner, names: dict[str, str]) -> None:
        self.inner = inner
        self.path = inner.path
        self.skip: set[str] = set()
        inner_entries = inner.entries()
        shown = set(names.values())
        self._names = {new: old for new, old in names.items() if old in inner_entries}
        self._names.update({k: k for k in inner_entries if k not in shown and k.startswith("model/")})
        self._entries = {new: inner_entries[old] for new, old in self._names.items()}
        held = inner.held()
        self._held = {new: held[old] for new, old in self._names.items() if old in held}
        self.metadata: dict = {}
        self.pieces: dict[str, list[tuple[int, int, str]]] = {}
        self._old_key: dict[str, str] = {}
        for new, old in self._names.items():
            if old in inner.metadata:  # a 0-dim entry
                self.metadata[new], self._old_key[new] = inner.metadata[old], old
            for start, n, key in inner.pieces.get(old, ()):
                renamed = new + key[len(old) :]
                self.metadata[renamed], self._old_key[renamed] = inner.metadata[key], key
                self.pieces.setdefault(new, []).append((start, n, renamed))

    @property
    def read_keys(self) -> list[str]:
        """Keys the inner reader read (its own names)."""
        return self.inner.read_keys

    @property
    def read_numel(self) -> int:
        """Elements the inner reader read."""
        return self.inner.read_numel

    def check(self) -> None:
        """The inner reader's own check."""
        self.inner.check()

    def held(self) -> dict[str, int]:
        """Elements stored per (new) entry."""
        return dict(self._held)

    def entries(self) -> dict:
        """``(shape, dtype)`` per (new) entry."""
        return dict(self._entries)

    def groups(self) -> list[dict]:
        """The inner reader's optimizer hyperparameters."""
        return self.inner.groups()

    def load(self, tensors) -> None:
        """Fill ``tensors`` (new keys) through one inner load; a key shown twice is read once."""
        by_old: dict[str, list] = {}
        for key, t in tensors.items():
            by_old.setdefault(self._old_key[key], []).append(t)
        self.inner.load({old: ts[0] for old, ts in by_old.items()})
        for ts in by_old.values():
            for t in ts[1:]:
                t.copy_(ts[0])

    def read(self, keys):
        """``keys`` (new names) into fresh CPU tensors."""
        return SliceReader.read(self, keys)

    def overlapping(self, prefix: str, lo: int, hi: int) -> list[str]:
        """Keys of the pieces of ``prefix`` that overlap elements ``[lo, hi)``."""
        return SliceReader.overlapping(self, prefix, lo, hi)

    def scalar_key(self, prefix: str) -> str | None:
        """The key of a 0-dim entry (None when absent)."""
        return SliceReader.scalar_key(self, prefix)

    def assemble(self, prefix: str, lo: int, hi: int, loaded) -> object:
        """Elements ``[lo, hi)`` of ``prefix`` from the loaded pieces."""
        return SliceReader.assemble(self, prefix, lo, hi, loaded)

    def read_box(self, prefix: str, box: tuple[slice, ...]):
        """The block ``box`` of entry ``prefix`` (a reader that has ``read_box``: a safetensors folder)."""
        return self.inner.read_box(self._names[prefix], box)
