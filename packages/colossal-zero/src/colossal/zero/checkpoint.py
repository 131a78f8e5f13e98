"""State of a :class:`~colossal.zero.ZeroOptimizer`: full (gathered, loadable by plain torch) and
sharded (``torch.distributed.checkpoint``, loadable on any world size).

[Note: the sharded layout]
Every rank saves, for each parameter slice inside its shard, plain 1-D fp32 tensors keyed
``model/<name>@<first element>`` and ``optim/<name>/<state key>@<first element>``; scalar
optimizer states (Adam's ``step``) are saved as ``optim/<name>/<key>`` by every rank (DCP keeps
one copy). Hyperparameters and the loss scaler travel pickled in ``zero/extra``. To load, a rank
reads the checkpoint's metadata, asks DCP for just the chunks that overlap the slices it now
owns, and copies the overlaps, so the saving and loading world sizes (and stages) are independent.
"""

from __future__ import annotations

import itertools
import pickle
from typing import TYPE_CHECKING

import torch

from colossal.comm import all_gather
from colossal.zero._flat_param import FlatParam

if TYPE_CHECKING:
    from colossal.zero.optimizer import ZeroOptimizer

__all__ = [
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "save_sharded",
    "load_sharded",
]


def _gather_full(zero: ZeroOptimizer, shard: torch.Tensor) -> torch.Tensor:
    """All-gather one ``(shard_numel,)`` tensor into a ``(padded_numel,)`` fp32 one."""
    src = shard.to(device=zero.device, dtype=torch.float32)
    return all_gather(src, zero.config.group, tag="zero.checkpoint").cpu()


def _values(flat: FlatParam) -> torch.Tensor:
    """This rank's fp32 values of the buffer (the master when there is one)."""
    return flat.master if flat.master is not None else flat.shard if flat.shard is not None else flat.local(flat.full)


def _is_shard(flat: FlatParam, v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == flat.shard_numel


def full_model_state_dict(zero: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Gather every parameter (fp32, CPU); buffers and unmanaged parameters are copied."""
    values: dict[int, torch.Tensor] = {}
    for flat in zero.flats:
        full = _gather_full(zero, _values(flat))
        for p, off, n, shape in zip(flat.params, flat.offsets, flat.numels, flat.shapes, strict=True):
            values[id(p)] = full[off : off + n].view(shape).clone()
    out = {}
    for k, t in zero.module.state_dict(keep_vars=True).items():  # never read a sharded parameter's storage
        out[k] = values[id(t)] if id(t) in values else t.detach().cpu().clone()
    return out


def _param_index(zero: ZeroOptimizer) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(itertools.chain(*zero._orig_groups))}


def full_optimizer_state_dict(zero: ZeroOptimizer) -> dict:
    """``torch.optim``-format state over the original parameters, plus ``"loss_scaler"``."""
    index, state = _param_index(zero), {}
    for flat in (f for f in zero.flats if f.master is not None):
        per = [{} for _ in flat.params]
        for key, v in zero._flat_state(flat).items():
            full = _gather_full(zero, v) if _is_shard(flat, v) else None
            for d, off, n, shape in zip(per, flat.offsets, flat.numels, flat.shapes, strict=True):
                d[key] = full[off : off + n].view(shape).clone() if full is not None else _copy(v)
        state.update({index[id(p)]: d for p, d in zip(flat.params, per, strict=True) if d})
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in orig]}
        for g, orig in zip(zero.optimizer.param_groups, zero._orig_groups, strict=True)
    ]
    return {"state": state, "param_groups": groups, "loss_scaler": zero.scaler.state_dict()}


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _publish(zero: ZeroOptimizer) -> None:
    """After the masters changed: refresh the working parameters from them."""
    for flat in zero.flats:
        if flat.master is None or flat.master_aliased:
            continue
        if flat.shard is not None:
            flat.shard.copy_(flat.master)
    if zero.config.stage != 3:
        zero._publish_params()


def load_full_model_state_dict(zero: ZeroOptimizer, state_dict: dict[str, torch.Tensor]) -> None:
    """Scatter a plain model state dict into the masters and working parameters."""
    for flat in zero.flats:
        full32 = torch.zeros(flat.padded_numel, dtype=torch.float32)
        for name, off, n, shape in zip(flat.names, flat.offsets, flat.numels, flat.shapes, strict=True):
            if name not in state_dict:
                raise ValueError(f"state_dict has no entry {name!r} (a parameter of the model)")
            if tuple(state_dict[name].shape) != tuple(shape):
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(state_dict[name].shape)}, expected {shape}")
            full32[off : off + n].copy_(state_dict[name].reshape(-1))
        _values(flat).copy_(flat.local(full32))
    _publish(zero)


def load_full_optimizer_state_dict(zero: ZeroOptimizer, state_dict: dict) -> None:
    """Load ``torch.optim``-format state (as :func:`full_optimizer_state_dict` writes it)."""
    groups = state_dict.get("param_groups", [])
    if len(groups) != len(zero.optimizer.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer {len(zero.optimizer.param_groups)}")
    for g, sg in zip(zero.optimizer.param_groups, groups, strict=True):
        g.update({k: v for k, v in sg.items() if k != "params"})
    index = _param_index(zero)
    for flat in (f for f in zero.flats if f.master is not None):
        per = [state_dict["state"].get(index[id(p)]) for p in flat.params]
        first = next((d for d in per if d), None)
        if first is None:
            continue
        new = {}
        for key, v0 in first.items():
            if isinstance(v0, torch.Tensor) and v0.dim() > 0:
                full = torch.zeros(flat.padded_numel, dtype=v0.dtype)
                for d, off, n in zip(per, flat.offsets, flat.numels, strict=True):
                    if d:
                        full[off : off + n].copy_(d[key].reshape(-1))
                new[key] = flat.local(full).clone().to(flat.master.device)
            else:
                new[key] = _copy(v0)
        zero._set_flat_state(flat, new)
    if "loss_scaler" in state_dict:
        zero.scaler.load_state_dict(state_dict["loss_scaler"])


def save_sharded(zero: ZeroOptimizer, path: str) -> None:
    """Write this rank's slices (see the module note) with ``dcp.save``; call on every rank."""
    sd: dict[str, torch.Tensor] = {}
    for flat in zero.flats:
        vals = _values(flat).detach().float().cpu()
        state = zero._flat_state(flat) if flat.master is not None else {}
        for s in flat.slices():
            name, lo = flat.names[s.index], s.shard_start
            sd[f"model/{name}@{s.param_start}"] = vals[lo : lo + s.numel].clone()
            for key, v in state.items():
                if _is_shard(flat, v):
                    sd[f"optim/{name}/{key}@{s.param_start}"] = v[lo : lo + s.numel].detach().cpu().clone()
        for name, (key, v) in itertools.product(flat.names, state.items()):
            if not _is_shard(flat, v):
                sd[f"optim/{name}/{key}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    extra = {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups],
        "loss_scaler": zero.scaler.state_dict(),
    }
    sd["zero/extra"] = torch.frombuffer(bytearray(pickle.dumps(extra)), dtype=torch.uint8)
    import torch.distributed.checkpoint as dcp  # heavy import, only when checkpointing

    dcp.save(sd, checkpoint_id=path)


def load_sharded(zero: ZeroOptimizer, path: str) -> None:
    """Read the chunks overlapping this rank's slices from a :func:`save_sharded` checkpoint."""
    import torch.distributed.checkpoint as dcp  # heavy import, only when checkpointing

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    chunks: dict[str, list[tuple[int, int, str]]] = {}
    for key, m in meta.items():
        if "@" in key:
            prefix, start = key.rsplit("@", 1)
            chunks.setdefault(prefix, []).append((int(start), m.size[0], key))
    wanted = {k for k in meta if "@" not in k and (k.startswith("optim/") or k == "zero/extra")}
    for flat in zero.flats:
        for s in flat.slices():
            for prefix in _prefixes(flat.names[s.index], chunks):
                wanted.update(
                    k for st, n, k in chunks[prefix] if st < s.param_start + s.numel and s.param_start < st + n
                )
    loaded = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in wanted}
    dcp.load(loaded, checkpoint_id=path)
    for flat in zero.flats:
        _values(flat).copy_(_assemble(flat, "model/{}", chunks, loaded))
        if flat.master is not None:
            _load_flat_state(zero, flat, chunks, loaded)
    extra = pickle.loads(loaded["zero/extra"].numpy().tobytes())
    for g, sg in zip(zero.optimizer.param_groups, extra["param_groups"], strict=True):
        g.update(sg)
    zero.scaler.load_state_dict(extra["loss_scaler"])
    _publish(zero)


def _prefixes(name: str, chunks: dict) -> list[str]:
    return [p for p in chunks if p == f"model/{name}" or p.startswith(f"optim/{name}/")]


def _assemble(flat: FlatParam, pattern: str, chunks: dict, loaded: dict) -> torch.Tensor:
    """This rank's ``(shard_numel,)`` buffer filled from the overlapping saved chunks."""
    out = torch.zeros(flat.shard_numel, dtype=torch.float32)
    for s in flat.slices():
        lo, hi = s.param_start, s.param_start + s.numel
        for start, n, key in chunks.get(pattern.format(flat.names[s.index]), []):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out[s.shard_start + a - lo : s.shard_start + b - lo] = loaded[key][a - start : b - start]
    return out


def _load_flat_state(zero: ZeroOptimizer, flat: FlatParam, chunks: dict, loaded: dict) -> None:
    name0 = flat.names[0]
    keys = {p.split("/", 2)[2] for p in chunks if p.startswith(f"optim/{name0}/")}
    scalars = {k.split("/", 2)[2] for k in loaded if k.startswith(f"optim/{name0}/") and "@" not in k}
    if not keys and not scalars:
        return
    state = {k: _assemble(flat, f"optim/{{}}/{k}", chunks, loaded).to(flat.master.device) for k in keys}
    state.update({k: loaded[f"optim/{name0}/{k}"].clone() for k in scalars})
    zero._set_flat_state(flat, state)
