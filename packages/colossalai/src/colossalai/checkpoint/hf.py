"""Hugging Face ``save_pretrained`` folders: load one into a boosted model, write one back.

[Note: a safetensors folder as a flat-slice checkpoint]
Every plugin already loads a checkpoint from a :class:`~colossalai.checkpoint.SliceReader`, reading
only the pieces that overlap what its rank owns ([Note: flat-slice checkpoints]).
:class:`SafetensorsReader` shows a Hugging Face folder (``model.safetensors``, or shards plus
``model.safetensors.index.json``) through the same interface, so ZeRO, Gemini, FSDP, DDP and the
hybrid plugin need nothing new: each tensor of the folder is cut into virtual row-aligned pieces
``model/<name>@<start>`` of about ``piece_numel`` elements, and a read of some pieces is one
``safe_open(...).get_slice(name)[rows]`` per run of consecutive pieces, so a rank reads its rows
plus at most one piece at each end of its range. A tensor-parallel block that is not a range of
rows (a ``Shard(1)`` weight) is read as that block (``read_box``), never the whole tensor.

Names follow ``transformers``: the folder's names are the model's ``state_dict`` names; a tied
weight that the folder holds under one of its names only (GPT-2 saves ``transformer.wte.weight``,
not ``lm_head.weight``) loads into both; a folder of the base model (no ``transformer.`` prefix)
loads into a model with a head and the reverse (``base_model_prefix``); the model's
``_keys_to_ignore_on_load_unexpected`` / ``_keys_to_ignore_on_load_missing`` patterns are honoured;
a Mixtral folder in the per-expert layout that ``transformers`` 5.x writes (``[Note: Mixtral's
per-expert folder layout]``) loads into its stacked expert tensors. Everything else is strict:
missing, unexpected and mis-shaped tensors are one
:class:`~colossalai.checkpoint.CheckpointMismatchError`, before anything is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import types

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from colossalai.checkpoint.entries import Entry, compare_entries, dtype_name
from colossalai.checkpoint.errors import CheckpointMismatchError, IncompatibleEntries, unreadable
from colossalai.checkpoint.safetensors_io import INDEX_NAME

__all__ = [
    "FolderLayout",
    "SafetensorsReader",
    "load_pretrained",
    "pretrained_reader",
    "folder_names",
    "mixtral_layout",
    "save_pretrained",
    "parse_shard_size",
    "SINGLE_NAME",
]

SINGLE_NAME = "model.safetensors"
"""The file of a one-shard folder (``transformers`` writes no index then)."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _files(folder: pathlib.Path) -> dict[str, str]:
    """``tensor name -> file`` of the folder (index, or the single file)."""
    if (folder / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise unreadable(folder / INDEX_NAME, "the safetensors index", e) from e
        return dict(weight_map)
    if (folder / SINGLE_NAME).is_file():
        return {name: SINGLE_NAME for name in _header(folder / SINGLE_NAME)}
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise FileNotFoundError(
        f"{str(folder)!r} is not a Hugging Face safetensors folder: expected {SINGLE_NAME} or {INDEX_NAME}, "
        f"found {found[:12]} (a PyTorch .bin folder must be converted: save it with safe_serialization=True)"
    )


def folder_names(folder) -> list[str]:
    """The tensor names a safetensors folder holds (from its index, or its one file's header)."""
    return sorted(_files(pathlib.Path(folder)))


def _header(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``name -> (shape, dtype)`` of every tensor of one file (its header only)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), _DTYPES[sl.get_dtype()])
            return out
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # SafetensorError is a RuntimeError-like
        raise unreadable(path, "the safetensors file", e) from e
    except Exception as e:
        raise unreadable(path, "the safetensors file", e) from e


@dataclasses.dataclass(frozen=True, slots=True)
class FolderLayout:
    """How a folder's tensors map to the model's before name matching: ``rename`` (folder name ->
    model-side name) and ``stacked`` (model-side name -> its rows, each row the folder tensors of
    that name concatenated along their dim 0; the whole tensor stacks the rows along a new dim 0)."""

    rename: dict[str, str] = dataclasses.field(default_factory=dict)
    """Folder name -> the name it has in the model."""
    stacked: dict[str, list[list[str]]] = dataclasses.field(default_factory=dict)
    """Model-side name -> rows of folder names."""

    @property
    def consumed(self) -> set[str]:
        """Folder names read only as parts of a stacked tensor."""
        return {n for rows in self.stacked.values() for row in rows for n in row}

    def names(self, files) -> list[str]:
        """The model-side names the folder offers."""
        return sorted({self.rename.get(n, n) for n in files if n not in self.consumed} | set(self.stacked))


# [Note: Mixtral's per-expert folder layout]
# transformers 5.x holds a Mixtral layer's experts stacked (``mlp.experts.gate_up_proj`` (E, 2F, C),
# ``mlp.experts.down_proj`` (E, C, F), router ``mlp.gate.weight``) but its ``save_pretrained``
# writes the per-expert layout of the published checkpoints: ``block_sparse_moe.experts.{e}.w1``
# (gate, (F, C)), ``w3`` (up, (F, C)), ``w2`` (down, (C, F)) and ``block_sparse_moe.gate.weight``,
# converting back in ``from_pretrained``. Loading such a folder, expert row ``e`` of
# ``gate_up_proj`` is ``cat(w1_e, w3_e)`` and of ``down_proj`` is ``w2_e``: the reader offers both
# stacked tensors as row-aligned pieces like any other (a rank reads only its experts' files'
# tensors under expert parallelism). Our ``save_pretrained`` writes the model's own (stacked)
# names, which ``transformers`` 5.x ``from_pretrained`` loads strictly as they are.
_MIXTRAL_EXPERT = re.compile(r"^(?P<pre>.*)\.block_sparse_moe\.experts\.(?P<e>\d+)\.w(?P<w>[123])\.weight$")


def mixtral_layout(files, headers: dict[str, tuple[tuple[int, ...], torch.dtype]], expected: set[str]) -> FolderLayout:
    """``[Note: Mixtral's per-expert folder layout]``: the stacked expert tensors and renamed routers
    of every layer whose folder holds all of ``experts.{0..E-1}.w{1,2,3}`` with consistent shapes,
    when the model (``expected`` names) stores Mixtral experts stacked; otherwise nothing."""
    if not any(n.endswith(".mlp.experts.gate_up_proj") for n in expected):
        return FolderLayout()
    parts: dict[str, dict[int, dict[str, str]]] = {}
    for name in files:
        m = _MIXTRAL_EXPERT.match(name)
        if m:
            parts.setdefault(m["pre"], {}).setdefault(int(m["e"]), {})[m["w"]] = name
    layout = FolderLayout()
    for pre, experts in parts.items():
        complete = sorted(experts) == list(range(len(experts))) and all(len(w) == 3 for w in experts.values())
        shapes = {tuple(headers[experts[e][w]][0] for w in "123") for e in experts} if complete else set()
        if len(shapes) != 1 or len({headers[experts[0][w]][1] for w in "123"}) != 1:
            continue  # left as it is: strict matching reports it
        order = sorted(experts)
        layout.stacked[f"{pre}.mlp.experts.gate_up_proj"] = [[experts[e]["1"], experts[e]["3"]] for e in order]
        layout.stacked[f"{pre}.mlp.experts.down_proj"] = [[experts[e]["2"]] for e in order]
        if f"{pre}.block_sparse_moe.gate.weight" in headers:
            layout.rename[f"{pre}.block_sparse_moe.gate.weight"] = f"{pre}.mlp.gate.weight"
    return layout


class SafetensorsReader:
    """A Hugging Face safetensors folder through the :class:`~colossalai.checkpoint.SliceReader`
    interface (see ``[Note: a safetensors folder as a flat-slice checkpoint]``).

    ``layout``: the folder's own renames and stacked tensors (:class:`FolderLayout`, applied first);
    ``rename``: (layout) name -> model name (tied aliases, base-model prefix); ``drop``: (layout)
    names not offered at all (ignored duplicates). ``read_keys`` / ``read_numel`` count what this
    rank read, for tests and diagnostics.
    """

    def __init__(
        self,
        folder,
        *,
        piece_numel: int = 1 << 16,
        rename: dict[str, str] | None = None,
        drop=(),
        layout: FolderLayout | None = None,
    ) -> None:
        if piece_numel <= 0:
            raise ValueError(f"piece_numel must be positive, got {piece_numel}")
        self.folder = pathlib.Path(folder)
        self.path = str(self.folder)
        files = _files(self.folder)
        headers = {f: _header(self.folder / f) for f in sorted(set(files.values()))}
        absent = sorted(n for n, f in files.items() if n not in headers[f])
        if absent:
            raise unreadable(self.folder / INDEX_NAME, "the safetensors index", KeyError(f"{absent[:8]} in no shard"))
        rename, layout = rename or {}, layout or FolderLayout()
        self.files = files
        self.layout = layout
        self.sources: dict[str, tuple[str, str, tuple[int, ...], torch.dtype]] = {}  # prefix -> file, name, ...
        consumed = layout.consumed
        for name, f in files.items():
            named = layout.rename.get(name, name)
            if name not in consumed and named not in drop:
                shape, dtype = headers[f][name]
                self.sources[f"model/{rename.get(named, named)}"] = (f, name, shape, dtype)
        for named, rows in layout.stacked.items():  # f None: rows of parts (_slice)
            if named not in drop:
                first = [headers[files[n]][n] for n in rows[0]]
                shape = (len(rows), sum(s[0] for s, _ in first), *first[0][0][1:])
                self.sources[f"model/{rename.get(named, named)}"] = (None, named, shape, first[0][1])
        self.metadata: dict[str, types.SimpleNamespace] = {}
        self.pieces: dict[str, list[tuple[int, int, str]]] = {}
        self._where: dict[str, tuple[str, int, int]] = {}  # key -> (prefix, first row, last row)
        for prefix, (_, _, shape, dtype) in self.sources.items():
            self._cut(prefix, shape, dtype, piece_numel)
        self.skip: set[str] = set()
        self.read_keys: list[str] = []
        self.read_numel = 0

    def _cut(self, prefix: str, shape: tuple[int, ...], dtype: torch.dtype, piece_numel: int) -> None:
        meta = lambda n: types.SimpleNamespace(size=torch.Size(n), properties=types.SimpleNamespace(dtype=dtype))  # noqa: E731
        if not shape:
            self.metadata[prefix] = meta(())
            return
        row = math.prod(shape[1:])
        step = max(1, piece_numel // max(row, 1))
        for r in range(0, shape[0], step):
            rows = min(step, shape[0] - r)
            key = f"{prefix}@{r * row}"
            self.metadata[key] = meta((rows * row,))
            self.pieces.setdefault(prefix, []).append((r * row, rows * row, key))
            self._where[key] = (prefix, r, r + rows)

    # ---- what the strict check asks ------------------------------------------------------------
    def check(self) -> None:
        """Pieces are cut from whole tensors: they never overlap nor leave a gap."""

    def held(self) -> dict[str, int]:
        """Elements per entry."""
        return {p: math.prod(shape) for p, (_, _, shape, _) in self.sources.items()}

    def entries(self) -> dict[str, Entry]:
        """Every tensor's ``(shape, dtype name)`` from the file headers."""
        return {p: (shape, dtype_name(dtype)) for p, (_, _, shape, dtype) in self.sources.items()}

    def groups(self) -> list[dict]:
        """A pretrained folder holds no optimizer state."""
        raise CheckpointMismatchError(
            self.path, IncompatibleEntries(["extra/param_groups"], [], []), "a pretrained folder holds weights only"
        )

    # ---- reads -------------------------------------------------------------------------------
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (keys of :attr:`metadata`) in place; one ``get_slice`` per run of
        consecutive pieces of a tensor. Not collective (every rank reads its own files)."""
        self.read_keys += list(tensors)
        self.read_numel += sum(t.numel() for t in tensors.values())
        runs: dict[str, list[list[str]]] = {}
        for key in sorted(tensors, key=lambda k: self._where.get(k, (k, 0))[:2]):
            if key not in self._where:  # a 0-dim tensor
                tensors[key].copy_(self._slice(key, ()))
                continue
            prefix, lo, _ = self._where[key]
            group = runs.setdefault(prefix, [])
            if group and self._where[group[-1][-1]][2] == lo:
                group[-1].append(key)
            else:
                group.append([key])
        for prefix, groups in runs.items():
            for run in groups:
                rows = slice(self._where[run[0]][1], self._where[run[-1]][2])
                values = self._slice(prefix, (rows,)).reshape(-1)
                offset = 0
                for key in run:
                    n = tensors[key].numel()
                    tensors[key].copy_(values[offset : offset + n])
                    offset += n

    def _slice(self, prefix: str, index: tuple) -> torch.Tensor:
        f, name, shape, _ = self.sources[prefix]
        if f is None:  # stacked: read the rows asked for, part by part
            rows = range(shape[0])[index[0]] if index else range(shape[0])
            parts = self.layout.stacked[name]
            whole = torch.stack([torch.cat([self._part(n, ()) for n in parts[r]]) for r in rows])
            return whole[(slice(None), *index[1:])] if len(index) > 1 else whole
        return self._part(name, index, f)

    def _part(self, name: str, index: tuple, f: str | None = None) -> torch.Tensor:
        f = f or self.files[name]
        try:
            with safe_open(str(self.folder / f), framework="pt") as handle:
                sl = handle.get_slice(name)
                return sl[index] if index else handle.get_tensor(name)
        except Exception as e:
            raise unreadable(self.folder / f, "the safetensors file", e) from e

    def read_box(self, prefix: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The block ``box`` of tensor ``prefix`` (a tensor-parallel block that is not a row range)."""
        out = self._slice(prefix, box)
        self.read_keys.append(prefix)
        self.read_numel += out.numel()
        return out

    def read(self, keys) -> dict[str, torch.Tensor]:
        """``keys`` into fresh CPU tensors."""
        out = {k: torch.empty(self.metadata[k].size, dtype=self.metadata[k].properties.dtype) for k in sorted(keys)}
        self.load(out)
        return out

    def overlapping(self, prefix: str, lo: int, hi: int) -> list[str]:
        """Keys of the pieces of ``prefix`` that overlap elements ``[lo, hi)``."""
        return [k for s, n, k in self.pieces.get(prefix, ()) if s < hi and lo < s + n]

    def scalar_key(self, prefix: str) -> str | None:
        """The key of a 0-dim entry (None when absent)."""
        return prefix if prefix in self.metadata else None

    def assemble(self, prefix: str, lo: int, hi: int, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``prefix`` from the loaded pieces."""
        from colossalai.checkpoint.slices import SliceReader

        return SliceReader.assemble(self, prefix, lo, hi, loaded)


# ---- matching the folder's names to the model's -------------------------------------------------
def _patterns(model: nn.Module, attr: str) -> list[str]:
    return [p for p in (getattr(model, attr, None) or ()) if isinstance(p, str)]


def _match_names(files: list[str], expected: set[str], model: nn.Module, alias: dict[str, str]):
    """``(rename, drop)`` for the folder's ``files`` against the model's ``expected`` names
    (tied aliases and the base-model prefix, as ``from_pretrained`` matches them)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    direct = [n for n in files if n in expected]
    add = [n for n in files if f"{prefix}.{n}" in expected] if prefix else []
    strip = [n for n in files if prefix and n.startswith(f"{prefix}.") and n[len(prefix) + 1 :] in expected]
    if prefix and not direct and add:  # a base model's folder into a model with a head
        rename = {n: f"{prefix}.{n}" for n in files}
    elif prefix and not direct and strip:  # a model with a head's folder into its base model
        rename = {n: n[len(prefix) + 1 :] for n in files if n.startswith(f"{prefix}.")}
    else:
        rename = {}
    target = [rename.get(n, n) for n in files]
    drop = set()
    for n, t in zip(files, target, strict=True):
        if t in alias:  # a tied weight under a later name: load it under the first one
            if alias[t] in target:
                drop.add(n)  # both names saved: the first one is loaded (they are one tensor)
            else:
                rename[n] = alias[t]
    return rename, drop


def _ignored(names: list[str], patterns: list[str]) -> list[str]:
    return [n for n in names if any(re.search(p, n[len("model/") :]) for p in patterns)]


def pretrained_reader(folder, user: nn.Module, expected: dict[str, Entry], *, strict: bool = True):
    """``(reader, found)``: a :class:`SafetensorsReader` of ``folder`` under the names of ``expected``
    (``model/<name>`` entries of ``user``, matched as ``from_pretrained`` matches them: tied
    aliases, the base-model prefix, the ``_keys_to_ignore_on_load_*`` patterns), with the missing
    entries in its ``skip``, and what a non-strict load skips. Strict like ``load_state_dict``: one
    :class:`~colossalai.checkpoint.CheckpointMismatchError` before anything is read. Not collective."""
    from colossalai.checkpoint.slices import aliases

    folder = pathlib.Path(folder)
    alias = aliases(user)
    files = _files(folder)
    wanted = {k[len("model/") :] for k in expected}
    headers = {n: h for f in sorted(set(files.values())) for n, h in _header(folder / f).items()}
    layout = mixtral_layout(sorted(files), headers, wanted)
    rename, drop = _match_names(layout.names(files), wanted, user, alias)
    reader = SafetensorsReader(folder, rename=rename, drop=drop, layout=layout)
    found = compare_entries(reader.entries(), reader.held(), expected, with_optimizer=False)
    ignored_missing = set(_ignored(found.missing, _patterns(user, "_keys_to_ignore_on_load_missing")))
    ignored_unexpected = set(_ignored(found.unexpected, _patterns(user, "_keys_to_ignore_on_load_unexpected")))
    found = IncompatibleEntries(
        [k for k in found.missing if k not in ignored_missing],
        [k for k in found.unexpected if k not in ignored_unexpected],
        found.mismatched,
    )
    if found.mismatched or (strict and found):
        hint = "" if found.mismatched else "pass strict=False to load the tensors that match and get the lists back"
        raise CheckpointMismatchError(folder, found, hint)
    if found.unexpected or ignored_unexpected:  # not offered to the engines at all
        named = [reader.sources[k][1] for k in [*found.unexpected, *ignored_unexpected]]
        gone = {layout.rename.get(n, n) for n in named}
        reader = SafetensorsReader(folder, rename=rename, drop=drop | gone, layout=layout)
    reader.skip = set(found.missing) | ignored_missing
    return reader, found


def load_pretrained(folder, plugin, model: nn.Module, *, strict: bool = True) -> IncompatibleEntries:
    """Load a ``save_pretrained`` folder into ``model`` (the plugin's wrapped module): each rank
    reads the slices it owns. Strict like ``load_state_dict`` (see the module note); returns what a
    non-strict load skipped. Collective: every rank calls it."""
    with torch.profiler.record_function("colossalai.checkpoint::load_pretrained"):
        user = plugin.unwrap(model)
        reader, found = pretrained_reader(folder, user, plugin.checkpoint_entries(model), strict=strict)
        plugin.load_checkpoint_pieces(model, None, reader)
    return found


# ---- writing ---------------------------------------------------------------------------------------
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_shard_size(size: int | str) -> int:
    """Bytes of ``max_shard_size`` as ``transformers`` takes it: an int, or ``"5GB"``, ``"500MB"``,
    ``"2GiB"`` (decimal units, ``i`` for binary)."""
    if isinstance(size, bool):
        raise TypeError(f"max_shard_size must be an int or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", size.upper())
        if m is None:
            raise ValueError(f"max_shard_size must look like '5GB', '500MB' or '2GiB', got {size!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise TypeError(f"max_shard_size must be an int or a string like '5GB', got {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_pretrained(
    state: dict[str, torch.Tensor], folder, *, max_shard_size: int | str = "5GB", config=None, tied=()
) -> pathlib.Path:
    """Write ``state`` (whole tensors) as ``transformers`` does: ``model.safetensors``, or shards
    ``model-0000i-of-0000N.safetensors`` of at most ``max_shard_size`` plus the index, and
    ``config.json`` from ``config`` (anything with ``save_pretrained``, e.g. a ``PretrainedConfig``).
    ``tied``: names left out because they are a later name of a tied weight (as ``transformers``
    leaves out ``lm_head.weight``). Safetensors files of an earlier export in ``folder`` are removed."""
    max_bytes = parse_shard_size(max_shard_size)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX_NAME]:
        old.unlink(missing_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items() if k not in set(tied)}
    shards = _shards(state, max_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if config is not None:
        config.save_pretrained(str(folder))
    return folder
