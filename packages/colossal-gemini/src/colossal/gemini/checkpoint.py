"""State of a Gemini model and optimizer: full (gathered, plain torch) and sharded (``torch.distributed.checkpoint``).

[Note: what the state holds]
The source of truth is the fp32 master shards (the working copy is derived from them), so the full
model state holds fp32 values under the wrapped module's own names (tied names included): it loads
into the plain ``torch.nn.Module``. The optimizer state is keyed by parameter *name* (not index),
which makes it independent of chunk layout and world size. The sharded form stores each rank's
slices under ``<name>@<first element>`` keys plus a small index per rank, so that a checkpoint saved
on N ranks loads on M ranks with any chunk size: each rank reads exactly the overlapping slices.
"""

from __future__ import annotations

import pickle

import torch

import colossal.comm as comm

__all__ = [
    "model_state_dict",
    "load_model_state_dict",
    "optimizer_state_dict",
    "load_optimizer_state_dict",
    "save_sharded",
    "load_sharded",
]


def _gather(manager, shard: torch.Tensor) -> torch.Tensor:
    """The whole chunk-sized fp32 tensor from every rank's shard."""
    if not manager.sharded:
        return shard.detach().to("cpu", torch.float32)
    dev = manager.device.device
    return comm.all_gather(shard.detach().to(dev, torch.float32), group=manager.group, tag="gemini.state").cpu()


def _names(ddp) -> dict[torch.nn.Parameter, list[str]]:
    names: dict = {}
    for n, p in ddp.module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(n)
    return names


def model_state_dict(ddp) -> dict[str, torch.Tensor]:
    """Gathered fp32 parameters (and the module's buffers) under the module's names; collective."""
    m, names, out = ddp.manager, _names(ddp), {}
    for chunk in m.chunks:
        full = _gather(m, chunk.master)
        for info in chunk.tensors:
            value = full[info.offset : info.offset + info.numel].view(info.param.shape).clone()
            for n in names[info.param]:
                out[n] = value
    for n, b in ddp.module.named_buffers():
        out[n] = b.detach().cpu().clone()
    return out


def load_model_state_dict(ddp, state: dict[str, torch.Tensor]) -> None:
    """Load a full state (from :func:`model_state_dict` or a plain module) into masters and working data."""
    m, names = ddp.manager, _names(ddp)
    for chunk in m.chunks:
        lo, hi = chunk.shard_range(m.rank)
        full = torch.zeros(chunk.size, dtype=torch.float32)
        for info in chunk.tensors:
            key = names[info.param][0]
            if key not in state:
                raise ValueError(f"state dict is missing {key!r}")
            value = state[key]
            if tuple(value.shape) != tuple(info.param.shape):
                raise ValueError(f"{key}: expected shape {tuple(info.param.shape)}, got {tuple(value.shape)}")
            full[info.offset : info.offset + info.numel] = value.reshape(-1).float()
        with torch.no_grad():
            chunk.master.copy_(full[lo:hi])
            m.refresh_working(chunk)
    for n, b in ddp.module.named_buffers():
        if n in state:
            b.copy_(state[n])


def _state_keys(optim) -> list[str]:
    keys: list[str] = []
    for slices in optim.slices.values():
        for fake, *_ in slices:
            for k, t in optim.optim.state.get(fake, {}).items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and k not in keys:
                    keys.append(k)
    return sorted(keys)


def _param_of_name(ddp) -> dict[str, torch.nn.Parameter]:
    return {ns[0]: p for p, ns in _names(ddp).items()}


def optimizer_state_dict(optim) -> dict:
    """Gathered optimizer state keyed by parameter name, plus scalars, hyper-parameters and the loss scaler."""
    m, ddp = optim.manager, optim.model
    keys = _state_keys(optim)
    state: dict[str, dict] = {}
    for chunk in m.chunks:
        for k in keys:
            shard = torch.zeros(chunk.shard_size, dtype=torch.float32)
            for fake, lo, hi, _ in optim.slices.get(chunk.id, ()):
                shard[lo:hi] = optim.optim.state[fake][k].detach().cpu()
            full = _gather(m, shard)
            for info in chunk.tensors:
                state.setdefault(info.name, {})[k] = full[info.offset : info.offset + info.numel].view(info.param.shape)
    scalars = _scalars(optim)
    for name in state:
        state[name].update(scalars)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.optim.param_groups]
    del ddp
    return {"state": state, "param_groups": groups, "loss_scaler": optim.scaler.state_dict()}


def _scalars(optim) -> dict:
    for slices in optim.slices.values():
        for fake, *_ in slices:
            st = optim.optim.state.get(fake, {})
            return {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in st.items()
                if not (isinstance(v, torch.Tensor) and v.dim() > 0)
            }
    return {}


def load_optimizer_state_dict(optim, sd: dict) -> None:
    """Load a state from :func:`optimizer_state_dict` (any world size / chunk size)."""
    m = optim.manager
    for g, saved in zip(optim.optim.param_groups, sd["param_groups"]):
        g.update(saved)
    for chunk in m.chunks:
        for fake, lo, hi, name in optim.slices.get(chunk.id, ()):
            info = m.chunk_of[_find(m, name)][1]
            s_lo = chunk.shard_range(m.rank)[0]
            a, b = s_lo + lo - info.offset, s_lo + hi - info.offset  # slice range inside the parameter
            entry = sd["state"].get(name)
            if entry is None:
                continue
            st = {}
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    st[k] = v.reshape(-1)[a:b].to(fake.device, fake.dtype).clone()
                else:
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v
            optim.optim.state[fake] = st
    optim.scaler.load_state_dict(sd["loss_scaler"])


def _find(manager, name: str) -> torch.nn.Parameter:
    for p, (_, info) in manager.chunk_of.items():
        if info.name == name:
            return p
    raise KeyError(name)


def _my_slices(manager):
    """``(info, start in parameter, master view)`` for every parameter slice this rank holds."""
    for chunk in manager.chunks:
        s_lo, s_hi = chunk.shard_range(manager.rank)
        for info in chunk.tensors:
            a, b = max(info.offset, s_lo), min(info.offset + info.numel, s_hi)
            if a < b:
                yield chunk, info, a - info.offset, (a - s_lo, b - s_lo)


def _sharded_dict(optim, ddp) -> dict:
    m, sd = ddp.manager, {}
    fakes = {}
    if optim is not None:
        for cid, slices in optim.slices.items():
            for fake, lo, _, _ in slices:
                fakes[(cid, lo)] = fake
    for chunk, info, start, (lo, hi) in _my_slices(m):
        sd[f"model/{info.name}@{start}"] = chunk.master[lo:hi].detach().cpu().clone()
        fake = fakes.get((chunk.id, lo))
        if fake is not None:
            for k, t in optim.optim.state.get(fake, {}).items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    sd[f"optim/{k}/{info.name}@{start}"] = t.detach().cpu().clone()
    return sd


def _dcp_kwargs(manager) -> dict:
    # replicated (keep_gathered) ranks save the same keys: the planner writes each once
    return {"process_group": manager.group} if manager.dp_size > 1 else {"no_dist": True}


def save_sharded(path: str, model, optimizer=None) -> None:
    """Save this rank's slices with ``torch.distributed.checkpoint`` (collective over the data-parallel group)."""
    import torch.distributed.checkpoint as dcp

    sd = _sharded_dict(optimizer, model)
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optim.param_groups]
        meta = {"scalars": _scalars(optimizer), "param_groups": groups, "loss_scaler": optimizer.scaler.state_dict()}
        sd["meta/optim"] = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)  # one opaque blob
    dcp.save(sd, checkpoint_id=path, **_dcp_kwargs(model.manager))


def _overlaps(keys, prefix: str, name: str, start: int, stop: int, sizes):
    """Saved slices ``(key, saved start)`` of ``name`` under ``prefix`` that overlap ``[start, stop)``."""
    for key in keys:
        head, _, s = key.rpartition("@")
        if not s.isdigit():
            continue
        if head == f"{prefix}{name}":
            s = int(s)
            if s < stop and s + sizes[key] > start:
                yield key, s


def load_sharded(path: str, model, optimizer=None) -> None:
    """Load a :func:`save_sharded` checkpoint saved with any world size and chunk size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    m = model.manager
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    sizes = {k: v.size[0] for k, v in meta.items() if hasattr(v, "size") and len(v.size) == 1}
    wanted, targets = {}, []
    for chunk, info, start, (lo, hi) in _my_slices(m):
        stop = start + hi - lo
        prefixes = ["model/"] + ([f"optim/{k}/" for k in _saved_state_keys(meta)] if optimizer else [])
        for prefix in prefixes:
            for key, s in _overlaps(sizes, prefix, info.name, start, stop, sizes):
                wanted[key] = torch.zeros(sizes[key], dtype=torch.float32)
                targets.append((prefix, chunk, lo, start, stop, key, s))
    if optimizer is not None:
        wanted["meta/optim"] = torch.zeros(sizes["meta/optim"], dtype=torch.uint8)
    dcp.load(wanted, checkpoint_id=path, **_dcp_kwargs(m))
    _apply(m, optimizer, wanted, targets)


def _saved_state_keys(meta) -> list[str]:
    return sorted({k.split("/")[1] for k in meta if k.startswith("optim/")})


def _apply(m, optimizer, wanted: dict, targets: list) -> None:
    fakes = {}
    if optimizer is not None:
        for cid, slices in optimizer.slices.items():
            for fake, lo, _, _ in slices:
                fakes[(cid, lo)] = fake
    for prefix, chunk, lo, start, stop, key, s in targets:
        a, b = max(start, s), min(stop, s + wanted[key].numel())
        src = wanted[key][a - s : b - s]
        if prefix == "model/":
            chunk.master[lo + a - start : lo + b - start].copy_(src)
            continue
        fake = fakes[(chunk.id, lo)]
        state = optimizer.optim.state.setdefault(fake, {})
        k = prefix.split("/")[1]
        if k not in state:
            state[k] = torch.zeros_like(fake)
        state[k][a - start : b - start].copy_(src)
    for chunk in m.chunks:
        m.refresh_working(chunk)
    if optimizer is not None:
        saved = pickle.loads(wanted["meta/optim"].numpy().tobytes())
        for fake in fakes.values():
            optimizer.optim.state.setdefault(fake, {}).update(
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved["scalars"].items()}
            )
        for g, sg in zip(optimizer.optim.param_groups, saved["param_groups"]):
            g.update(sg)
        optimizer.scaler.load_state_dict(saved["loss_scaler"])
