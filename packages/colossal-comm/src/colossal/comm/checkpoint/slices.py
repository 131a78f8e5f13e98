"""The flat-slice checkpoint format shared by ZeRO, Gemini and every ``colossalai`` Booster plugin,
and its reader.

[Note: flat-slice checkpoints]
A checkpoint is one ``torch.distributed.checkpoint`` (DCP) directory of plain tensors:

* ``model/<name>@<start>``: a 1-D piece of the flattened parameter (or buffer) ``<name>``, holding
  its elements ``[start, start + numel)``;
* ``optim/<name>/<key>@<start>``: the same for a parameter-shaped optimizer state (``exp_avg``);
* ``model/<name>``, ``optim/<name>/<key>``: a 0-dim tensor (BatchNorm's ``num_batches_tracked``,
  Adam's ``step``) or a Python scalar, whole, under its plain name: one key scheme for every
  plugin (ZeRO and Gemini once wrote 0-dim buffers as ``@0`` pieces; readers still accept that);
* ``extra/param_groups``: the optimizer's hyperparameters per group, pickled;
* ``extra/entries/rank<r>``: every entry's logical shape and dtype ([Note: strict loading] in
  :mod:`colossal.comm.checkpoint.entries`).

Any non-overlapping pieces that cover a tensor are a valid checkpoint of it, so every layout writes
what it holds and nothing more: ZeRO and Gemini ranks write their own slices of the flat buffers
(ranges that cross parameter boundaries become one piece per parameter); FSDP2 ranks write their
``Shard(0)`` rows (a contiguous range of the flattened tensor); DDP ranks write whole tensors (the
same key on every rank: DCP writes it once); tensor-parallel blocks that are not one contiguous
range (``Shard(1)``, 2D/2.5D/3D blocks) are gathered by the hybrid plugin and written whole. Tied
parameters are written once, under their first name. To load, a rank reads the metadata (key ->
size), asks DCP for the pieces that overlap the ranges it owns and copies the overlaps, so no rank
of a sharded plugin allocates more than its share plus the pieces straddling its boundaries.

Why not DCP's own resharding (DTensor chunks of the full-shape tensors)? DCP chunks are boxes of
the N-D tensor, while ZeRO's and Gemini's shards are ranges of a flat buffer: a range is a box
only when it spans whole rows, so the engines would have to gather. 1-D pieces keyed by start
express every layout here, and the overlap search is a few lines (:class:`SliceReader`).
"""

from __future__ import annotations

import json
import math
import pathlib
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

from colossal.comm.checkpoint.entries import ENTRIES_PREFIX, Entry, entry_of_key
from colossal.comm.checkpoint.errors import CheckpointError, CheckpointMismatchError, IncompatibleEntries, unreadable
from colossal.comm.checkpoint.integrity import verify_files

__all__ = [
    "SliceReader",
    "GROUPS_KEY",
    "pieces_from_state",
    "fill_state",
    "groups_blob",
    "apply_groups",
    "piece_index",
    "aliases",
    "model_entries",
]

GROUPS_KEY = "extra/param_groups"
"""Key of the pickled optimizer hyperparameters (one dict per param group, without ``params``)."""


def aliases(module: nn.Module) -> dict[str, str]:
    """``name -> first name`` for every second (third, ...) name of a tied parameter."""
    first: dict[int, str] = {}
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), n) != n:
            out[n] = first[id(p)]
    return out


def model_entries(state: dict, alias: dict[str, str]) -> dict[str, Entry]:
    """``model/<name> -> (logical shape, dtype)`` of a name-keyed model state dict (a DTensor has
    its global shape); tied names after the first are left out (they are saved once)."""
    return {
        f"model/{n}": (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for n, t in state.items()
        if n not in alias and isinstance(t, torch.Tensor)
    }


def piece_index(metadata) -> dict[str, list[tuple[int, int, str]]]:
    """``prefix -> [(first element, numel, key)]`` of every 1-D piece (``<prefix>@<start>``) in a
    checkpoint's DCP ``state_dict_metadata``."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for key, m in metadata.items():
        head, _, start = key.rpartition("@")
        if head and start.isdigit() and len(getattr(m, "size", ())) == 1:
            out.setdefault(head, []).append((int(start), m.size[0], key))
    return out


def groups_blob(groups: list[dict]) -> torch.Tensor:
    """The hyperparameters of ``groups`` (``params`` left out) as a pickled uint8 tensor."""
    plain = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return torch.frombuffer(bytearray(pickle.dumps(plain)), dtype=torch.uint8)


def apply_groups(groups: list[dict], saved: list[dict]) -> None:
    """Update the hyperparameters of ``groups`` (in place) from a checkpoint's."""
    if len(saved) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved)} param groups, the optimizer {len(groups)}")
    for g, sg in zip(groups, saved, strict=True):
        g.update({k: v for k, v in sg.items() if k != "params"})


def _layout(t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """``(local tensor, its first element in the flattened tensor)``; the start is None when the
    local block is not one contiguous range (``Shard(d)`` with a longer dimension before ``d``)."""
    if not isinstance(t, DTensor):
        return t, 0
    dims = [p.dim for p in t.placements if isinstance(p, Shard)]
    if any(math.prod(t.shape[:d]) > 1 for d in dims):
        return t.to_local(), None
    offsets = t.__create_chunk_list__()[0].offsets  # the DCP protocol of DTensor
    strides = [math.prod(t.shape[i + 1 :]) for i in range(t.dim())]
    return t.to_local(), sum(o * s for o, s in zip(offsets, strides, strict=True))


def _put(out: dict, prefix: str, value) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        out[prefix] = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
        return
    local, start = _layout(value)
    if start is None:  # collective over the DTensor's mesh; every rank decides the same way
        local, start = value.full_tensor(), 0
    if local.numel():
        out[f"{prefix}@{start}"] = local.detach().reshape(-1)


def pieces_from_state(model_sd: dict, optim_sd: dict | None, alias: dict[str, str]) -> dict[str, torch.Tensor]:
    """This rank's pieces from name-keyed state dicts in the ``torch.distributed.checkpoint.state_dict``
    layout (plain tensors are whole, DTensors contribute their local block)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model_sd.items():
        if name not in alias:
            _put(out, f"model/{name}", t)
    if optim_sd is not None:
        for name, entry in optim_sd["state"].items():
            for k, v in entry.items() if name not in alias else ():
                _put(out, f"optim/{name}/{k}", v)
        out[GROUPS_KEY] = groups_blob(optim_sd["param_groups"])
    return out


class SliceReader:
    """A flat-slice checkpoint directory: its metadata, and loads of just the pieces asked for.

    Every file is verified before DCP reads it ([Note: checksums] in
    :mod:`colossal.comm.checkpoint.integrity`); a file that cannot be read raises
    :class:`~colossal.comm.checkpoint.CheckpointError` naming it. ``skip`` holds the entries a
    non-strict load leaves alone. ``read_keys`` / ``read_numel`` count what this rank loaded (for
    tests and diagnostics). ``dcp_kwargs`` go to every ``dcp.load`` (``process_group=`` for a
    checkpoint of a sub-group, ``no_dist=True`` for a single process).
    """

    def __init__(self, path, **dcp_kwargs) -> None:
        self.path = str(path)
        self.dcp_kwargs = dcp_kwargs
        meta_file = pathlib.Path(self.path) / ".metadata"
        verify_files(self.path, [".metadata"])
        try:
            metadata = dcp.FileSystemReader(self.path).read_metadata()
        except Exception as e:  # UnpicklingError, EOFError, ... of a damaged file
            raise unreadable(meta_file, "the checkpoint metadata", e) from e
        self.metadata = metadata.state_dict_metadata
        self._storage = metadata.storage_data or {}
        self.pieces = piece_index(self.metadata)
        self.skip: set[str] = set()
        self._verified: set[str] = set()  # files checked once per reader
        self.read_keys: list[str] = []
        self.read_numel = 0

    def check(self) -> None:
        """CheckpointError when a tensor's pieces overlap or leave a gap: decided from the metadata
        alone, so on every rank alike, before any collective."""
        for prefix, pieces in self.pieces.items():
            end = 0
            for start, n, key in sorted(pieces):
                if start != end:
                    raise CheckpointError(f"{self.path}: the pieces of {prefix!r} overlap or leave a gap at {key!r}")
                end = start + n

    def held(self) -> dict[str, int]:
        """Elements stored per entry (``model/<name>``, ``optim/<name>/<key>``)."""
        return {prefix: sum(n for _, n, _ in pieces) for prefix, pieces in self.pieces.items()}

    def entries(self) -> dict[str, Entry]:
        """Every entry's ``(logical shape, dtype)``: the union of the saving ranks' tables, or, for a
        checkpoint without tables, what the metadata tells (shape unknown for pieces)."""
        tables = [k for k in self.metadata if k.startswith(ENTRIES_PREFIX)]
        if tables:
            out: dict[str, Entry] = {}
            for blob in self.read(tables).values():
                for key, (shape, dtype) in json.loads(blob.numpy().tobytes()).items():
                    out[key] = (tuple(shape), dtype)
            return out
        out = {}
        for key, m in self.metadata.items():
            if key.startswith("extra/") or not hasattr(m, "properties"):
                continue
            entry = entry_of_key(key)
            shape = None if entry != key else tuple(m.size)
            out[entry] = (shape, str(m.properties.dtype).removeprefix("torch."))
        return out

    def _verify(self, keys) -> None:
        """Check the files holding ``keys`` before DCP reads them (they must reach each piece's end)."""
        wanted, ends = set(keys), {}
        for index, info in self._storage.items():
            if index.fqn in wanted and info.relative_path not in self._verified:
                ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        verify_files(self.path, ends, ends)
        self._verified.update(ends)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (keys of this checkpoint) in place: one ``dcp.load``, collective."""
        self.read_keys += list(tensors)
        self.read_numel += sum(t.numel() for t in tensors.values())
        self._verify(tensors)
        try:
            dcp.load(tensors, checkpoint_id=self.path, **self.dcp_kwargs)
        except CheckpointException as e:  # a BaseException: re-raise as an ordinary one
            raise CheckpointError(
                f"torch.distributed.checkpoint failed to read {self.path!r} (a file changed while loading, "
                f"or another rank failed):\n{str(e)[:2000]}",
                self.path,
            ) from e

    def overlapping(self, prefix: str, lo: int, hi: int) -> list[str]:
        """Keys of the pieces of ``prefix`` that overlap elements ``[lo, hi)``."""
        return [k for s, n, k in self.pieces.get(prefix, ()) if s < hi and lo < s + n]

    def read(self, keys) -> dict[str, torch.Tensor]:
        """Load ``keys`` into fresh CPU tensors."""
        out = {k: torch.empty(self.metadata[k].size, dtype=self.metadata[k].properties.dtype) for k in sorted(keys)}
        self.load(out)
        return out

    def scalar_key(self, prefix: str) -> str | None:
        """The key of a 0-dim entry: ``prefix`` itself, or the 1-element ``prefix@0`` piece older
        ZeRO/Gemini checkpoints wrote for 0-dim buffers; None when absent."""
        if prefix in self.metadata:
            return prefix
        legacy = self.pieces.get(prefix, ())
        return legacy[0][2] if len(legacy) == 1 and legacy[0][1] == 1 else None

    def assemble(self, prefix: str, lo: int, hi: int, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``prefix`` from the loaded pieces; ValueError when not covered."""
        out, covered = None, 0
        for s, n, k in self.pieces.get(prefix, ()):
            a, b = max(lo, s), min(hi, s + n)
            if a < b:
                out = torch.empty(hi - lo, dtype=loaded[k].dtype) if out is None else out
                out[a - lo : b - lo] = loaded[k][a - s : b - s]
                covered += b - a
        if covered != hi - lo:
            raise ValueError(f"the checkpoint holds {covered} of elements [{lo}, {hi}) of {prefix!r}")
        return out

    def groups(self) -> list[dict]:
        """The saved optimizer hyperparameters (CheckpointMismatchError for a model-only checkpoint)."""
        if GROUPS_KEY not in self.metadata:
            raise CheckpointMismatchError(
                self.path,
                IncompatibleEntries([GROUPS_KEY], [], []),
                "it holds no optimizer state (a model-only checkpoint from save_model?): load it with load_model",
            )
        return pickle.loads(self.read([GROUPS_KEY])[GROUPS_KEY].numpy().tobytes())


def _jobs(model_sd: dict, optim_sd: dict | None, alias: dict[str, str]):
    """``(prefix, container, key, optimizer-state name or None)`` of every tensor to fill."""
    for name in model_sd:
        yield f"model/{alias.get(name, name)}", model_sd, name, None
    for name, entry in optim_sd["state"].items() if optim_sd is not None else ():
        for k in entry:
            yield f"optim/{alias.get(name, name)}/{k}", entry, k, name


def _request(reader: SliceReader, prefix: str, value) -> tuple[list[str], tuple | None]:
    """Keys to read for one tensor and ``(local, lo, hi, box)`` to fill it (None: a scalar)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        key = reader.scalar_key(prefix)
        if key is None:
            raise ValueError(f"the checkpoint has no entry {prefix!r}")
        return [key], (key,)
    held = sum(n for _, n, _ in reader.pieces.get(prefix, ()))
    if held != value.numel():  # the global numel: every rank decides alike, before any collective
        raise ValueError(f"the checkpoint holds {held} of the {value.numel()} elements of {prefix!r}")
    local, start = _layout(value)
    if start is None:  # a non-contiguous block: read the whole tensor, keep the block
        box = tuple(slice(o, o + n) for o, n in zip(value.__create_chunk_list__()[0].offsets, local.shape, strict=True))
        if hasattr(reader, "read_box"):  # a reader that reads blocks (a safetensors folder): just the block
            return [], (local, None, None, box)
        return reader.overlapping(prefix, 0, value.numel()), (local, 0, value.numel(), box)
    return reader.overlapping(prefix, start, start + local.numel()), (local, start, start + local.numel(), None)


def _skipped(reader: SliceReader, prefix: str) -> bool:
    """A non-strict load's missing entry, or optimizer state the checkpoint does not hold (torch's
    optimizers have none for a parameter that never had a gradient): left as it is."""
    if prefix.startswith("optim/"):
        param = "model/" + prefix[len("optim/") :].rsplit("/", 1)[0]
        return param in reader.skip or (prefix not in reader.pieces and reader.scalar_key(prefix) is None)
    return prefix in reader.skip


@torch.no_grad()
def fill_state(reader: SliceReader, model_sd: dict, optim_sd: dict | None, alias: dict[str, str]) -> None:
    """Fill template state dicts (as :func:`pieces_from_state` takes them) in place from ``reader``:
    one load of the overlapping pieces; the optimizer's hyperparameters too. A template entry for a
    parameter the checkpoint holds no optimizer state for (one that never had a gradient; a
    template made by a zero-gradient step has one) is removed, so the loaded optimizer has none,
    as ``torch.optim`` would; a non-strict load's skipped parameter keeps its entry."""
    jobs, keys = [], set()
    stateless = set(optim_sd["state"]) if optim_sd is not None else set()
    for prefix, container, k, name in _jobs(model_sd, optim_sd, alias):
        if _skipped(reader, prefix):
            continue
        stateless.discard(name)
        wanted, target = _request(reader, prefix, container[k])
        keys.update(wanted)
        jobs.append((prefix, container, k, target))
    loaded = reader.read(keys)
    for prefix, container, k, target in jobs:
        if len(target) == 1:  # a scalar
            value, saved = container[k], loaded[target[0]].reshape(())
            container[k] = value.copy_(saved) if isinstance(value, torch.Tensor) else saved.item()
            continue
        local, lo, hi, box = target
        if local.numel() and lo is None:
            local.copy_(reader.read_box(prefix, box))
        elif local.numel():
            values = reader.assemble(prefix, lo, hi, loaded)
            local.copy_(values.view(container[k].shape)[box] if box is not None else values.view(local.shape))
    for name in stateless:
        if f"model/{alias.get(name, name)}" not in reader.skip:
            del optim_sd["state"][name]
    if optim_sd is not None:
        apply_groups(optim_sd["param_groups"], reader.groups())
