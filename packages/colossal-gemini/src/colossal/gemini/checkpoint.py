"""State of a Gemini model and optimizer: full (gathered, plain torch) and sharded (``torch.distributed.checkpoint``).

[Note: what the state holds]
The source of truth is the fp32 master shards (the working copy is derived from them), so the full
model state holds fp32 values under the wrapped module's own names (tied names included): it loads
into the plain ``torch.nn.Module``. The optimizer state is keyed by parameter *name* (not index),
which makes it independent of chunk layout and world size.

[Note: the flat-slice layout]
The sharded form is the stack's flat-slice format (the same as ``colossal.zero``'s and every
``colossalai`` Booster plugin's): each rank writes its master slices as 1-D fp32 pieces
``model/<name>@<first element>``, its optimizer-state slices as ``optim/<name>/<key>@<first element>``
and scalar states as ``optim/<name>/<key>`` (persistent buffers: whole ``model/<name>@0``; a 0-dim
one, BatchNorm's ``num_batches_tracked``, as ``model/<name>`` like every writer of the format, and
a 1-element ``@0`` piece of older checkpoints still loads). A checkpoint saved
on N ranks by any writer loads on M ranks with any chunk size: each rank reads the metadata and
then exactly the pieces overlapping its slices (:func:`load_sharded_state_dict`).
:func:`save_sharded` also writes the entry table and the checksums of its files, and
:func:`load_sharded` checks both before anything changes, like the Booster (``colossal.comm.checkpoint``).

[Note: state is collective]
Gathering (:func:`model_state_dict`, :func:`optimizer_state_dict`, ``GeminiDDP.state_dict``),
saving and loading sharded state (:func:`save_sharded`, :func:`load_sharded`) run collectives over
the data-parallel group: call them on every rank, never under ``if rank == 0:``. Each first runs the
arrival check of ``colossal.comm`` ([Note: the arrival check] in ``colossal.comm.arrival``): a call
on some ranks only raises a :class:`~colossal.comm.checkpoint.CheckpointError` naming the ranks that
did not call it after ``GeminiDDP(checkpoint_timeout=...)`` seconds (default
``COLOSSAL_COMM_TIMEOUT`` if set, else 300), instead of hanging.
"""

from __future__ import annotations

import functools
import inspect
import pickle

import torch
import torch.distributed as dist

import colossal.comm as comm
from colossal.comm.checkpoint import CheckpointError

__all__ = [
    "model_state_dict",
    "load_model_state_dict",
    "optimizer_state_dict",
    "load_optimizer_state_dict",
    "save_sharded",
    "load_sharded",
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_entries",
]


_HINT = (
    "Gathering, saving and loading Gemini state are collective: call them on every rank (not under "
    "'if rank == 0:'); a rank that is legitimately slower needs a larger GeminiDDP(checkpoint_timeout=...)"
)


def _where(*args, **kwargs):
    """The arrival check's ``(group, timeout)``: the model's data-parallel group and its
    ``checkpoint_timeout`` (an optimizer reaches them through its model)."""
    target = next(a for a in [*args, *kwargs.values()] if hasattr(a, "manager"))  # the model or optimizer
    ddp = target.model if hasattr(target, "optim") else target  # a GeminiOptimizer
    return ddp.manager.group, ddp.config.checkpoint_timeout


def _collective(op: str):
    return comm.monitored(f"colossal.gemini.{op}", _where, error=CheckpointError, hint=_HINT)


def _pages_disk(fn):
    """With a disk tier, run ``fn`` with the disk-resident masters and states paged in (and written back
    after): see ``[Note: scratch, not checkpoint]`` in ``colossal.gemini.disk``."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        opt = bound.get("optimizer", bound.get("optim"))
        model = bound.get("model", bound.get("ddp")) or (opt.model if opt is not None else None)
        if model is None or getattr(model.manager, "disk", None) is None:
            return fn(*args, **kwargs)
        from colossal.gemini.disk import paged_in

        with paged_in(model, opt):
            return fn(*args, **kwargs)

    return wrapper


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a ``state_dict`` holds (``register_buffer(..., persistent=False)`` ones are not)."""
    out = []
    for mod_name, mod in module.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, b))
    return out


def _gather(manager, shard: torch.Tensor) -> torch.Tensor:
    """The whole chunk-sized fp32 tensor from every rank's shard."""
    if not manager.sharded:
        return shard.detach().to("cpu", torch.float32)
    dev = manager.device.device
    return comm.all_gather(shard.detach().to(dev, torch.float32), group=manager.group, tag="gemini.state").cpu()


def _values(manager, chunk) -> torch.Tensor:
    """This rank's shard of the chunk's values: the fp32 master, or a frozen chunk's working shard
    (it has no master: [Note: frozen chunks] in ``colossal.gemini.chunk``)."""
    return manager.read_working(chunk) if chunk.frozen else chunk.master


def _set_values(manager, chunk, values: torch.Tensor) -> None:
    """Set this rank's shard of the chunk's values (master and working data, or a frozen chunk's
    working shard)."""
    if chunk.frozen:
        manager.write_working(chunk, values)
        return
    chunk.master.copy_(values)
    manager.refresh_working(chunk)


def _names(ddp) -> dict[torch.nn.Parameter, list[str]]:
    names: dict = {}
    for n, p in ddp.module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(n)
    return names


@_collective("model_state_dict")
@_pages_disk
def model_state_dict(ddp) -> dict[str, torch.Tensor]:
    """Gathered fp32 parameters (and the module's persistent buffers) under the module's names.
    Collective (an all-gather per chunk): call on every rank, not only on the one that writes
    ([Note: state is collective])."""
    m, names, out = ddp.manager, _names(ddp), {}
    for chunk in m.chunks:
        full = _gather(m, _values(m, chunk))
        for info in chunk.tensors:
            value = full[info.offset : info.offset + info.numel].view(info.param.shape).clone()
            for n in names[info.param]:
                out[n] = value
    for n, b in _buffers(ddp.module):
        out[n] = b.detach().cpu().clone()
    return out


def _check_full(ddp, state: dict, strict: bool):
    """torch's ``load_state_dict`` rules and wording (``colossal.comm.checkpoint.check_state_dict``)."""
    from colossal.comm.checkpoint import check_state_dict

    expected = {n: tuple(p.shape) for n, p in ddp.module.named_parameters(remove_duplicate=False)}
    expected.update({n: tuple(b.shape) for n, b in _buffers(ddp.module)})
    return check_state_dict(type(ddp.module).__name__, expected, state, strict)


@_pages_disk
def load_model_state_dict(ddp, state: dict[str, torch.Tensor], strict: bool = True):
    """Load a full state (from :func:`model_state_dict` or a plain module) into masters, working data
    and buffers; strict like ``torch.nn.Module.load_state_dict`` (checked before anything changes).
    Returns torch's ``_IncompatibleKeys``. No communication, but every rank calls it with the full
    state (each keeps its own shards)."""
    result = _check_full(ddp, state, strict)
    m, names = ddp.manager, _names(ddp)
    for chunk in m.chunks:
        lo, hi = chunk.shard_range(m.rank)
        full = torch.zeros(chunk.size, dtype=torch.float32)
        full[lo:hi] = _values(m, chunk).detach().cpu()  # a non-strict load keeps what the state lacks
        for info in chunk.tensors:
            key = next((n for n in names[info.param] if n in state), None)
            if key is not None:
                full[info.offset : info.offset + info.numel] = state[key].reshape(-1).float()
        with torch.no_grad():
            _set_values(m, chunk, full[lo:hi])
    with torch.no_grad():
        for n, b in _buffers(ddp.module):
            if n in state:
                b.copy_(state[n])
    return result


def _layouts(optim, with_state: bool = True) -> list:
    """Each chunk as a :class:`~colossal.comm.checkpoint.FlatShard` (``[Note: one optimizer-state
    path]`` in ``colossal.comm.checkpoint.optim_state``): this rank's shard of the chunk, the
    states of the parameter slices it holds, and the scalars of every parameter it knows (one it
    holds a slice of, or an empty slice of a layer-wise rule); the others are unknown here."""
    from colossal.comm.checkpoint import UNKNOWN, FlatShard

    m, out = optim.manager, []
    known = {}
    fakes_of = {cid: slices for cid, slices in optim.slices.items()}
    for fake, name in optim.empty if with_state else ():
        st = optim.optim.state.get(fake)
        known[name] = {k: v for k, v in st.items() if _is_scalar(v)} if st else None
    for chunk in m.chunks:
        lo, hi = chunk.shard_range(m.rank)
        states: dict[str, torch.Tensor] = {}
        for fake, a, b, name in fakes_of.get(chunk.id, ()) if with_state else ():
            st = optim.optim.state.get(fake)
            known[name] = {k: v for k, v in st.items() if _is_scalar(v)} if st else None
            for k, v in (st or {}).items():
                if not _is_scalar(v):
                    states.setdefault(k, torch.zeros(hi - lo))[a:b] = v.detach().reshape(-1).cpu().float()
        out.append(
            FlatShard(
                names=[info.name for info in chunk.tensors],
                shapes=[tuple(info.param.shape) for info in chunk.tensors],
                offsets=[info.offset for info in chunk.tensors],
                lo=lo,
                hi=hi,
                states=states,
                # a frozen parameter has no state on any rank ([Note: frozen chunks] in chunk.py)
                scalars=[None if chunk.frozen else known.get(info.name, UNKNOWN) for info in chunk.tensors]
                if with_state
                else [],
            )
        )
    return out


@_collective("optimizer_state_dict")
@_pages_disk
def optimizer_state_dict(optim) -> dict:
    """Gathered optimizer state keyed by parameter name, plus hyper-parameters and the loss scaler:
    a parameter that never had a gradient has no entry, every entry has its scalars (``step``)
    with its moments (``[Note: one optimizer-state path]``). Collective (an all-gather per chunk
    and state key): call on every rank ([Note: state is collective])."""
    from colossal.comm.checkpoint import gather_full_state

    m = optim.manager
    state = gather_full_state(_layouts(optim), lambda t, b: _gather(m, t), group=m.group, distributed=m.sharded)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.optim.param_groups]
    return {"state": state, "param_groups": groups, "loss_scaler": optim.scaler.state_dict()}


def _is_scalar(v) -> bool:
    return not (isinstance(v, torch.Tensor) and v.dim() > 0)


@_pages_disk
def load_optimizer_state_dict(optim, sd: dict) -> None:
    """Load a state from :func:`optimizer_state_dict` (any world size / chunk size): a parameter
    without an entry is left without state; every problem (group count, unknown names, sizes) is
    listed in one ``ValueError`` before anything changes. No communication, but every rank calls it
    with the full state (each keeps its own slices)."""
    from colossal.comm.checkpoint import apply_groups, scatter_full_state

    m = optim.manager
    groups = sd.get("param_groups", [])
    if len(groups) != len(optim.optim.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer {len(optim.optim.param_groups)}")
    layouts = _layouts(optim, with_state=False)
    shares = scatter_full_state(layouts, sd.get("state", {}), what="this GeminiOptimizer")
    apply_groups(optim.optim.param_groups, groups)
    by_name = {}
    for chunk, layout, share in zip(m.chunks, layouts, shares, strict=True):
        for name, sc in zip(layout.names, share.scalars, strict=True):
            by_name[name] = (sc, share.states)
        for fake, lo, hi, name in optim.slices.get(chunk.id, ()):
            sc, states = by_name[name]
            if sc is None:
                optim.optim.state.pop(fake, None)
                continue
            per = {k: v[lo:hi].to(fake.device, fake.dtype).clone() for k, v in states.items()}
            optim.optim.state[fake] = {**sc, **per}
    for fake, name in optim.empty:  # layer-wise: the scalars, and empty per-element states
        sc, states = by_name[name]
        if sc is None:
            optim.optim.state.pop(fake, None)
        else:
            optim.optim.state[fake] = {**sc, **{k: fake.detach().new_zeros(0) for k in states}}
    if "loss_scaler" in sd:
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


def _fakes(optim) -> dict:
    """``(chunk id, start in the shard) -> the optimizer's slice parameter``."""
    if optim is None:
        return {}
    return {(cid, lo): fake for cid, slices in optim.slices.items() for fake, lo, _, _ in slices}


@_pages_disk
def sharded_state_dict(model, optimizer=None, *, names=None) -> dict[str, torch.Tensor]:
    """The pieces this rank writes in the flat-slice format (module note): views of its own master
    slices and optimizer states, scalars, and whole buffers; nothing is gathered. ``names``: only
    the pieces of these parameters and buffers (a frozen chunk holding none of them is not read,
    from the host or the disk tier)."""
    sd, fakes = {}, _fakes(optimizer)
    wanted = (lambda n: True) if names is None else set(names).__contains__
    values = {
        c.id: _values(model.manager, c)
        for c in model.manager.chunks
        if c.frozen and any(wanted(info.name) for info in c.tensors)
    }
    for chunk, info, start, (lo, hi) in _my_slices(model.manager):
        if not wanted(info.name):
            continue
        sd[f"model/{info.name}@{start}"] = values.get(chunk.id, chunk.master).detach()[lo:hi]
        for k, t in optimizer.optim.state.get(fakes.get((chunk.id, lo)), {}).items() if optimizer else ():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                sd[f"optim/{info.name}/{k}@{start}"] = t.detach()
            else:  # a Python float (LARS's scale) keeps its precision
                sd[f"optim/{info.name}/{k}"] = _scalar_tensor(t)
    for n, b in _buffers(model.module):
        if wanted(n):
            sd[f"model/{n}" if b.dim() == 0 else f"model/{n}@0"] = b.detach().reshape(b.shape if b.dim() == 0 else -1)
    return sd


def sharded_entries(model) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (logical shape, dtype name)`` of every model entry :func:`sharded_state_dict` writes
    (parameters as their fp32 masters), the same on every rank (for strict loading); no communication."""
    out = {}
    for chunk in model.manager.chunks:
        for info in chunk.tensors:
            out[info.name] = (tuple(info.param.shape), "float32")
    for n, b in _buffers(model.module):
        out[n] = (tuple(b.shape), str(b.dtype).removeprefix("torch."))
    return out


def _scalar_tensor(v) -> torch.Tensor:
    """A scalar state as a tensor; a Python float (LARS's ``scale``) keeps its double precision."""
    if isinstance(v, torch.Tensor):
        return v.detach()
    return torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else None)


def _dcp_kwargs(manager) -> dict:
    # replicated (keep_gathered) ranks save the same keys: the planner writes each once
    return {"process_group": manager.group} if manager.dp_size > 1 else {"no_dist": True}


def _dcp_rank(manager) -> int:
    return dist.get_rank(manager.group) if manager.dp_size > 1 else 0


@_collective("save_sharded")
@_pages_disk
def save_sharded(path: str, model, optimizer=None) -> None:
    """Save this rank's slices with ``torch.distributed.checkpoint``, plus its entry table (every
    entry's logical shape and dtype) and the checksums of the files it wrote. Collective over the
    data-parallel group: every rank calls it ([Note: state is collective])."""
    from colossal.comm.checkpoint import GROUPS_KEY, blob, groups_blob, save_flat  # imports DCP: only when saving

    sd = sharded_state_dict(model, optimizer)
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optim.param_groups]
        meta = {"param_groups": groups, "loss_scaler": optimizer.scaler.state_dict()}
        sd["meta/optim"] = blob(pickle.dumps(meta))  # with the loss scaler, for load_sharded
        sd[GROUPS_KEY] = groups_blob(optimizer.optim.param_groups)  # what every other reader of the format reads
    entries = {f"model/{n}": e for n, e in sharded_entries(model).items()}
    save_flat(path, sd, entries, _dcp_rank(model.manager), **_dcp_kwargs(model.manager))


def _by_name(keys) -> dict[str, list[str]]:
    """``optim/<name>/<key>[@start]`` keys (or piece prefixes) grouped by parameter name."""
    out: dict[str, list[str]] = {}
    for k in keys:
        if k.startswith("optim/"):
            out.setdefault(k[len("optim/") :].rsplit("@", 1)[0].rsplit("/", 1)[0], []).append(k)
    return out


def _check_complete(model, pieces, metadata, skip) -> None:
    """ValueError when the pieces of a parameter (or of its states) do not add up to it, or a buffer
    is absent (names in ``skip`` may be); every rank knows every chunk's tensors, so all raise
    alike, before the collective load."""
    states = _by_name(pieces)
    for chunk in model.manager.chunks:
        for info in chunk.tensors:
            for prefix in [f"model/{info.name}", *states.get(info.name, ())]:
                held = sum(n for _, n, _ in pieces.get(prefix, ()))
                if held != info.numel and not (held == 0 and info.name in skip):
                    raise ValueError(f"the checkpoint holds {held} of the {info.numel} elements of {prefix!r}")
    for n, b in _buffers(model.module):
        held = sum(k for _, k, _ in pieces.get(f"model/{n}", ())) or (b.numel() if f"model/{n}" in metadata else 0)
        if held != b.numel() and not (held == 0 and n in skip):
            raise ValueError(f"the checkpoint holds {held} of the {b.numel()} elements of 'model/{n}'")


def _targets(m, optimizer, metadata, pieces) -> tuple[set, list]:
    """Keys to read and ``(prefix, chunk, lo, start, stop, key, saved start)`` copies to make."""
    wanted, targets = set(), []
    states = _by_name(pieces) if optimizer is not None else {}
    scalars = _by_name(k for k in metadata if "@" not in k) if optimizer is not None else {}
    for _, name in optimizer.empty if optimizer is not None else ():
        wanted.update(scalars.get(name, ()))
    for chunk, info, start, (lo, hi) in _my_slices(m):
        stop = start + hi - lo
        wanted.update(scalars.get(info.name, ()))
        for prefix in [f"model/{info.name}", *states.get(info.name, ())]:
            for s, n, key in pieces.get(prefix, ()):
                if s < stop and s + n > start:
                    wanted.add(key)
                    targets.append((prefix, chunk, lo, start, stop, key, s))
    return wanted, targets


@_pages_disk
def load_sharded_state_dict(model, optimizer, metadata, load, *, skip: set[str] = frozenset()) -> None:
    """Load the flat-slice pieces (any writer, world size and chunk size) overlapping this rank's
    slices: ``metadata`` is the checkpoint's DCP ``state_dict_metadata``, ``load(tensors)`` fills a
    dict of tensors in place (one ``dcp.load``: collective, every rank calls it once). ``skip``:
    names the checkpoint lacks that stay as they are (a non-strict load)."""
    from colossal.comm.checkpoint import piece_index

    pieces = piece_index(metadata)
    _check_complete(model, pieces, metadata, skip)
    wanted, targets = _targets(model.manager, optimizer, metadata, pieces)
    buffers = {n: b for n, b in _buffers(model.module) if f"model/{n}" in pieces or f"model/{n}" in metadata}
    for n in buffers:  # a 0-dim buffer is one whole key, others are pieces
        wanted.update([f"model/{n}"] if f"model/{n}" in metadata else [k for *_, k in pieces[f"model/{n}"]])
    loaded = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in sorted(wanted)}
    load(loaded)
    _apply(model.manager, optimizer, loaded, targets)
    with torch.no_grad():
        for n, b in buffers.items():
            if f"model/{n}" in loaded:  # a 0-dim buffer
                b.copy_(loaded[f"model/{n}"])
            else:
                b.view(-1).copy_(torch.cat([loaded[k] for _, _, k in sorted(pieces[f"model/{n}"])]))
    if optimizer is not None:
        _load_scalars(optimizer, loaded, _by_name(pieces), skip)


def _load_scalars(optimizer, loaded: dict, states: dict[str, list[str]], skip) -> None:
    """Scalar states per parameter name into every slice of it (empty ones too, with empty tensor
    states); a parameter the checkpoint holds no state for is left without state, as ``torch.optim``
    loads it, unless a non-strict load skips it (``skip``)."""
    scalars = _by_name(k for k in loaded if "@" not in k)
    slices = [(fake, name) for ss in optimizer.slices.values() for fake, _, _, name in ss]
    for fake, name in [*slices, *optimizer.empty]:
        if name in skip:
            continue
        if name not in scalars and name not in states:
            optimizer.optim.state.pop(fake, None)
            continue
        state = optimizer.optim.state.setdefault(fake, {})
        state.update({k.rsplit("/", 1)[1]: loaded[k].clone() for k in scalars.get(name, ())})
        if fake.numel() == 0:  # an empty slice of a layer-wise rule: empty per-element states
            state.update({p.rsplit("/", 1)[1]: fake.detach().new_zeros(0) for p in states.get(name, ())})


@_collective("load_sharded")
@_pages_disk
def load_sharded(path: str, model, optimizer=None, *, strict: bool = True):
    """Load a :func:`save_sharded` checkpoint saved with any world size and chunk size (also one
    written by the ``colossalai`` Booster). Collective over the data-parallel group ([Note: state
    is collective]).

    Strict like ``load_state_dict``: one :class:`~colossal.comm.checkpoint.CheckpointMismatchError`
    (a ``ValueError``) lists every missing, unexpected and mis-shaped entry with shapes, on every
    rank, before anything changes; with ``strict=False`` missing entries stay as they are,
    unexpected ones are ignored, and both come back as
    :class:`~colossal.comm.checkpoint.IncompatibleEntries` (a mis-shaped entry is always an error).
    Every file is verified (size, CRC-32) before it is read: a truncated or corrupted one raises
    :class:`~colossal.comm.checkpoint.CheckpointError` naming it.
    """
    from colossal.comm.checkpoint import GROUPS_KEY, open_flat, read_blob

    expected = {f"model/{n}": e for n, e in sharded_entries(model).items()}
    kwargs = _dcp_kwargs(model.manager)
    reader, found = open_flat(path, expected, with_optimizer=optimizer is not None, strict=strict, **kwargs)
    saved = None
    if optimizer is not None:  # read (and verified) before anything changes
        if "meta/optim" in reader.metadata:
            saved = pickle.loads(read_blob(reader, "meta/optim"))
        else:  # a Booster checkpoint: hyperparameters only, the scaler stays
            saved = {"param_groups": pickle.loads(read_blob(reader, GROUPS_KEY))}
        if len(saved["param_groups"]) != len(optimizer.optim.param_groups):
            have, got = len(optimizer.optim.param_groups), len(saved["param_groups"])
            raise ValueError(f"the checkpoint {path!r} has {got} param groups, the optimizer {have}")
    skip = {k[len("model/") :] for k in reader.skip}
    load_sharded_state_dict(model, optimizer, reader.metadata, reader.load, skip=skip)
    if saved is not None:
        for g, sg in zip(optimizer.optim.param_groups, saved["param_groups"], strict=True):
            g.update({k: v for k, v in sg.items() if k != "params"})
        if "loss_scaler" in saved:
            optimizer.scaler.load_state_dict(saved["loss_scaler"])
    return found


def _apply(m, optimizer, wanted: dict, targets: list) -> None:
    fakes = _fakes(optimizer)
    frozen = {c.id: _values(m, c) for c in m.chunks if c.frozen}  # written back whole below
    for prefix, chunk, lo, start, stop, key, s in targets:
        a, b = max(start, s), min(stop, s + wanted[key].numel())
        src = wanted[key][a - s : b - s]
        if prefix.startswith("model/"):
            frozen.get(chunk.id, chunk.master)[lo + a - start : lo + b - start].copy_(src)
            continue
        fake = fakes[(chunk.id, lo)]
        state = optimizer.optim.state.setdefault(fake, {})
        k = prefix.rsplit("/", 1)[1]
        if k not in state:
            state[k] = torch.zeros_like(fake)
        state[k][a - start : b - start].copy_(src)
    for chunk in m.chunks:
        if chunk.frozen:
            m.write_working(chunk, frozen[chunk.id])
        else:
            m.refresh_working(chunk)
