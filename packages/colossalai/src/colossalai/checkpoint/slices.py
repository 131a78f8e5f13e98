"""The flat-slice checkpoint format shared by every Booster plugin, and its reader.

[Note: flat-slice checkpoints]
A checkpoint is one ``torch.distributed.checkpoint`` (DCP) directory of plain tensors:

* ``model/<name>@<start>``: a 1-D piece of the flattened parameter (or buffer) ``<name>``, holding
  its elements ``[start, start + numel)``;
* ``optim/<name>/<key>@<start>``: the same for a parameter-shaped optimizer state (``exp_avg``);
* ``optim/<name>/<key>``: a scalar state (Adam's ``step``);
* ``extra/param_groups``: the optimizer's hyperparameters per group, pickled.

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

import math
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["SliceReader", "GROUPS_KEY", "pieces_from_state", "fill_state", "groups_blob", "apply_groups", "aliases"]

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

    ``read_keys`` / ``read_numel`` count what this rank loaded (for tests and diagnostics).
    """

    def __init__(self, path) -> None:
        self.path = str(path)
        self.metadata = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        self.pieces: dict[str, list[tuple[int, int, str]]] = {}
        for key, m in self.metadata.items():
            head, _, start = key.rpartition("@")
            if head and start.isdigit() and len(getattr(m, "size", ())) == 1:
                self.pieces.setdefault(head, []).append((int(start), m.size[0], key))
        self.read_keys: list[str] = []
        self.read_numel = 0

    def check(self, names) -> None:
        """ValueError when a parameter of ``names`` has no pieces, or a tensor's pieces overlap or
        leave a gap: decided from the metadata alone, so on every rank alike, before any collective."""
        missing = [n for n in names if f"model/{n}" not in self.pieces]
        if missing:
            raise ValueError(f"{self.path} has no pieces of the parameters {missing[:4]} ({len(missing)} missing)")
        for prefix, pieces in self.pieces.items():
            end = 0
            for start, n, key in sorted(pieces):
                if start != end:
                    raise ValueError(f"{self.path}: the pieces of {prefix!r} overlap or leave a gap at {key!r}")
                end = start + n

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (keys of this checkpoint) in place: one ``dcp.load``, collective."""
        self.read_keys += list(tensors)
        self.read_numel += sum(t.numel() for t in tensors.values())
        dcp.load(tensors, checkpoint_id=self.path)

    def overlapping(self, prefix: str, lo: int, hi: int) -> list[str]:
        """Keys of the pieces of ``prefix`` that overlap elements ``[lo, hi)``."""
        return [k for s, n, k in self.pieces.get(prefix, ()) if s < hi and lo < s + n]

    def read(self, keys) -> dict[str, torch.Tensor]:
        """Load ``keys`` into fresh CPU tensors."""
        out = {k: torch.empty(self.metadata[k].size, dtype=self.metadata[k].properties.dtype) for k in sorted(keys)}
        self.load(out)
        return out

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
        """The saved optimizer hyperparameters (ValueError for a model-only checkpoint)."""
        if GROUPS_KEY not in self.metadata:
            raise ValueError(f"{self.path} holds no optimizer state (a model-only checkpoint?)")
        return pickle.loads(self.read([GROUPS_KEY])[GROUPS_KEY].numpy().tobytes())


def _jobs(model_sd: dict, optim_sd: dict | None, alias: dict[str, str]):
    """``(prefix, container, key)`` of every tensor to fill."""
    for name in model_sd:
        yield f"model/{alias.get(name, name)}", model_sd, name
    for name, entry in optim_sd["state"].items() if optim_sd is not None else ():
        for k in entry:
            yield f"optim/{alias.get(name, name)}/{k}", entry, k


def _request(reader: SliceReader, prefix: str, value) -> tuple[list[str], tuple | None]:
    """Keys to read for one tensor and ``(local, lo, hi, box)`` to fill it (None: a scalar)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        if prefix not in reader.metadata:
            raise ValueError(f"the checkpoint has no entry {prefix!r}")
        return [prefix], None
    held = sum(n for _, n, _ in reader.pieces.get(prefix, ()))
    if held != value.numel():  # the global numel: every rank decides alike, before any collective
        raise ValueError(f"the checkpoint holds {held} of the {value.numel()} elements of {prefix!r}")
    local, start = _layout(value)
    if start is None:  # a non-contiguous block: read the whole tensor, keep the block
        box = tuple(slice(o, o + n) for o, n in zip(value.__create_chunk_list__()[0].offsets, local.shape, strict=True))
        return reader.overlapping(prefix, 0, value.numel()), (local, 0, value.numel(), box)
    return reader.overlapping(prefix, start, start + local.numel()), (local, start, start + local.numel(), None)


@torch.no_grad()
def fill_state(reader: SliceReader, model_sd: dict, optim_sd: dict | None, alias: dict[str, str]) -> None:
    """Fill template state dicts (as :func:`pieces_from_state` takes them) in place from ``reader``:
    one load of the overlapping pieces; the optimizer's hyperparameters too."""
    jobs, keys = [], set()
    for prefix, container, k in _jobs(model_sd, optim_sd, alias):
        wanted, target = _request(reader, prefix, container[k])
        keys.update(wanted)
        jobs.append((prefix, container, k, target))
    loaded = reader.read(keys)
    for prefix, container, k, target in jobs:
        if target is None:
            value = container[k]
            container[k] = value.copy_(loaded[prefix]) if isinstance(value, torch.Tensor) else loaded[prefix].item()
            continue
        local, lo, hi, box = target
        if local.numel():
            values = reader.assemble(prefix, lo, hi, loaded)
            local.copy_(values.view(container[k].shape)[box] if box is not None else values.view(local.shape))
    if optim_sd is not None:
        apply_groups(optim_sd["param_groups"], reader.groups())
