"""State of a :class:`~colossal.zero.ZeroOptimizer`: full (gathered, loadable by plain torch) and
sharded (``torch.distributed.checkpoint``, loadable on any world size).

[Note: the sharded layout]
Every rank saves, for each parameter slice inside its shard, plain 1-D fp32 tensors keyed
``model/<name>@<first element>`` and ``optim/<name>/<state key>@<first element>``; scalar
optimizer states (Adam's ``step``) are saved as ``optim/<name>/<key>`` by every rank (DCP keeps
one copy); buffers and frozen parameters are whole ``model/<name>@0`` pieces, except 0-dim ones
(BatchNorm's ``num_batches_tracked``), saved whole as ``model/<name>`` like every other writer of
the format does (a 1-element ``model/<name>@0`` from older checkpoints still loads). Hyperparameters and
the loss scaler travel pickled in ``zero/extra``. To load, a rank reads the checkpoint's metadata,
asks DCP for just the chunks that overlap the slices it now owns, and copies the overlaps, so the
saving and loading world sizes (and stages) are independent. Any non-overlapping pieces that cover
a parameter load, whoever wrote them: this is the format of every ``colossalai`` Booster plugin
(``sharded_state_dict`` / ``load_sharded_state_dict`` are the narrow interface it uses).
:func:`save_sharded` also writes the entry table and the checksums of its files, and
:func:`load_sharded` checks both before anything changes, like the Booster (``colossal.comm.checkpoint``).

[Note: state is collective]
Every function here that gathers, saves or loads a sharded state runs collectives over the
engine's group: call it on every rank, never under ``if rank == 0:``. Each first runs the arrival
check of ``colossal.comm`` ([Note: the arrival check] in ``colossal.comm.arrival``): a call on some
ranks only raises a :class:`~colossal.comm.checkpoint.CheckpointError` naming the ranks that did
not call it after ``ZeroConfig.checkpoint_timeout`` seconds, instead of hanging.
"""

from __future__ import annotations

import itertools
import pickle

import torch
import torch.distributed as dist

from colossal.comm import all_gather, monitored
from colossal.comm.checkpoint import CheckpointError
from colossal.zero._flat_param import FlatParam
from colossal.zero._state_view import ZeroState as ZeroOptimizer  # structural: no import of optimizer.py

__all__ = [
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "save_sharded",
    "load_sharded",
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_entries",
]


_HINT = (
    "Gathering, saving and loading ZeRO state are collective: call them on every rank (not under 'if rank == 0:'); "
    "a rank that is legitimately slower needs a larger ZeroOptimizer(checkpoint_timeout=...)"
)


def _on_group(zero: ZeroOptimizer, *args, **kwargs):
    """The arrival check's ``(group, timeout)`` for a collective over the engine's shard group."""
    return zero.config.group, zero.config.checkpoint_timeout


def _on_world(zero: ZeroOptimizer, *args, **kwargs):
    """The same for ``dcp.save`` / ``dcp.load``, which run over the default group."""
    return None, zero.config.checkpoint_timeout


def _collective(op: str, where=_on_group):
    return monitored(f"colossal.zero.{op}", where, error=CheckpointError, hint=_HINT)


def _gather_full(zero: ZeroOptimizer, shard: torch.Tensor) -> torch.Tensor:
    """All-gather one ``(shard_numel,)`` tensor into a ``(padded_numel,)`` fp32 one."""
    src = shard.to(device=zero.device, dtype=torch.float32)
    return all_gather(src, zero.config.group, tag="zero.checkpoint").cpu()


def _values(flat: FlatParam) -> torch.Tensor:
    """This rank's fp32 values of the buffer (the master when there is one)."""
    return flat.master if flat.master is not None else flat.shard if flat.shard is not None else flat.local(flat.full)


def _is_shard(flat: FlatParam, v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == flat.shard_numel


@_collective("full_model_state_dict")
def full_model_state_dict(zero: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Gather every parameter (fp32, CPU); buffers and unmanaged parameters are copied.
    Collective (an all-gather per buffer): every rank calls it ([Note: state is collective])."""
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


def _layouts(zero: ZeroOptimizer, with_state: bool = True) -> tuple[list[FlatParam], list]:
    """The buffers with a master and their :class:`~colossal.comm.checkpoint.FlatShard` layouts
    (``[Note: one optimizer-state path]`` in ``colossal.comm.checkpoint.optim_state``)."""
    from colossal.comm.checkpoint import FlatShard

    flats = [f for f in zero.flats if f.master is not None]
    layouts = []
    for flat in flats:
        state = zero._flat_state(flat) if with_state else {}
        layouts.append(
            FlatShard(
                names=[str(i) for i in range(len(flat.params))],
                shapes=[tuple(s) for s in flat.shapes],
                offsets=list(flat.offsets),
                lo=flat.shard_start,
                hi=flat.shard_start + flat.shard_numel,
                states={k: v for k, v in state.items() if _is_shard(flat, v)},
                scalars=zero._param_states(flat) if with_state else [],
            )
        )
    return flats, layouts


def _keyed(zero: ZeroOptimizer, flats: list[FlatParam]) -> list[list[str]]:
    """Per buffer, each parameter's key in the ``torch.optim`` state (its index, as a string)."""
    index = _param_index(zero)
    return [[str(index[id(p)]) for p in flat.params] for flat in flats]


@_collective("full_optimizer_state_dict")
def full_optimizer_state_dict(zero: ZeroOptimizer) -> dict:
    """``torch.optim``-format state over the original parameters, plus ``"loss_scaler"``: a
    parameter that never had a gradient has no entry, every entry has its ``step`` with its
    moments (``[Note: one optimizer-state path]``). Collective (an all-gather per buffer and
    state key): every rank calls it ([Note: state is collective])."""
    from colossal.comm.checkpoint import gather_full_state

    flats, layouts = _layouts(zero)
    for layout, keys in zip(layouts, _keyed(zero, flats), strict=True):
        layout.names = keys
    full = gather_full_state(
        layouts,
        lambda t, b: _gather_full(zero, t),
        group=zero.config.group,
        distributed=dist.is_initialized(),
    )
    state = {int(k): v for k, v in sorted(full.items(), key=lambda kv: int(kv[0]))}
    index = _param_index(zero)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in orig]}
        for g, orig in zip(zero.optimizer.param_groups, zero._orig_groups, strict=True)
    ]
    return {"state": state, "param_groups": groups, "loss_scaler": zero.scaler.state_dict()}


def _publish(zero: ZeroOptimizer) -> None:
    """After the masters changed: refresh the working parameters from them."""
    for flat in zero.flats:
        if flat.master is None or flat.master_aliased:
            continue
        if flat.shard is not None:
            flat.shard.copy_(flat.master)
    if zero.config.stage != 3:
        zero._publish_params()


def _check_full(zero: ZeroOptimizer, state_dict: dict, strict: bool):
    """torch's ``load_state_dict`` rules and wording (``colossal.comm.checkpoint.check_state_dict``),
    against the parameters' real shapes (stage 3's placeholders are empty)."""
    from colossal.comm.checkpoint import check_state_dict

    expected = zero.module.state_dict(keep_vars=True)  # tied names included, like torch
    shapes = {id(p): tuple(s) for flat in zero.flats for p, s in zip(flat.params, flat.shapes, strict=True)}
    return check_state_dict(
        type(zero.module).__name__,
        {k: shapes.get(id(t), tuple(t.shape)) for k, t in expected.items()},
        state_dict,
        strict,
    )


@_collective("load_full_model_state_dict")
def load_full_model_state_dict(zero: ZeroOptimizer, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Scatter a plain model state dict into the masters, working parameters and buffers; strict
    like ``torch.nn.Module.load_state_dict`` (checked before anything changes). Returns torch's
    ``_IncompatibleKeys`` (what a non-strict load skipped). Collective (stages 1/2 re-gather the
    parameters): every rank calls it with the full dict ([Note: state is collective])."""
    result = _check_full(zero, state_dict, strict)
    for flat in zero.flats:
        full32 = torch.zeros(flat.padded_numel, dtype=torch.float32)
        present = torch.zeros(flat.padded_numel, dtype=torch.bool)
        for name, off, n in zip(flat.names, flat.offsets, flat.numels, strict=True):
            if name in state_dict:
                full32[off : off + n].copy_(state_dict[name].reshape(-1))
                present[off : off + n] = True
        values = _values(flat)
        values.copy_(torch.where(flat.local(present).to(values.device), flat.local(full32).to(values.device), values))
    managed = {id(p) for flat in zero.flats for p in flat.params}
    with torch.no_grad():
        for name, t in _unmanaged(zero, managed):
            if name in state_dict:
                t.copy_(state_dict[name])
    _publish(zero)
    return result


def load_full_optimizer_state_dict(zero: ZeroOptimizer, state_dict: dict) -> None:
    """Load ``torch.optim``-format state (as :func:`full_optimizer_state_dict` writes it, or a plain
    ``torch.optim`` optimizer's ``state_dict()`` over the same parameters): a parameter without an
    entry is left without state; every problem (group count, unknown parameter, sizes) is listed in
    one ``ValueError`` before anything changes. No communication, but every rank calls it with the
    full dict (each keeps its own slices)."""
    from colossal.comm.checkpoint import apply_groups, scatter_full_state

    groups = state_dict.get("param_groups", [])
    if len(groups) != len(zero.optimizer.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer {len(zero.optimizer.param_groups)}")
    flats, layouts = _layouts(zero, with_state=False)
    for layout, keys in zip(layouts, _keyed(zero, flats), strict=True):
        layout.names = keys
    entries = {str(k): v for k, v in state_dict.get("state", {}).items()}
    shares = scatter_full_state(layouts, entries, what="this ZeroOptimizer")
    apply_groups(zero.optimizer.param_groups, groups)
    for flat, share in zip(flats, shares, strict=True):
        dev = flat.master.device
        zero._set_param_states(flat, {k: v.to(dev) for k, v in share.states.items()}, share.scalars)
    if "loss_scaler" in state_dict:
        zero.scaler.load_state_dict(state_dict["loss_scaler"])


def sharded_state_dict(zero: ZeroOptimizer, *, include_optimizer: bool = True) -> dict[str, torch.Tensor]:
    """The pieces this rank writes (module note): views of its own slices, never a gathered tensor."""
    sd: dict[str, torch.Tensor] = {}
    managed = {id(p) for flat in zero.flats for p in flat.params}
    for flat in zero.flats:
        vals = _values(flat).detach()
        state = zero._flat_state(flat) if include_optimizer and flat.master is not None else {}
        scalars = zero._param_states(flat) if state else [None] * len(flat.params)
        for s in flat.slices():
            name, lo = flat.names[s.index], s.shard_start
            sd[f"model/{name}@{s.param_start}"] = vals[lo : lo + s.numel].float()
            for key, v in state.items() if scalars[s.index] is not None else ():  # no state: no entry
                if _is_shard(flat, v):
                    sd[f"optim/{name}/{key}@{s.param_start}"] = v.detach()[lo : lo + s.numel]
        for name, sc in zip(flat.names, scalars):  # per parameter (LARS's scale)
            for key, v in (sc or {}).items():
                sd[f"optim/{name}/{key}"] = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(v)
    for name, t in _unmanaged(zero, managed):  # buffers, frozen parameters
        sd[f"model/{name}" if t.dim() == 0 else f"model/{name}@0"] = t.detach().reshape(t.shape if t.dim() == 0 else -1)
    return sd


def _unmanaged(zero: ZeroOptimizer, managed: set[int]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the state-dict entries no flat buffer holds (buffers, frozen
    parameters), tied names once."""
    seen, out = set(managed), []
    for name, t in zero.module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def sharded_entries(zero: ZeroOptimizer) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (logical shape, dtype name)`` of every model entry :func:`sharded_state_dict`
    writes (parameters as their fp32 masters), known alike on every rank; nothing is gathered."""
    out = {}
    for flat in zero.flats:
        for name, shape in zip(flat.names, flat.shapes, strict=True):
            out[name] = (tuple(shape), "float32")
    managed = {id(p) for flat in zero.flats for p in flat.params}
    for name, t in _unmanaged(zero, managed):
        out[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return out


def _dcp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@_collective("save_sharded", _on_world)
def save_sharded(zero: ZeroOptimizer, path: str) -> None:
    """Write this rank's slices (see the module note) with ``dcp.save``, plus its entry table
    (every entry's logical shape and dtype) and the checksums of the files it wrote. Collective
    over the default group: every rank calls it with the same ``path`` ([Note: state is collective])."""
    from colossal.comm.checkpoint import GROUPS_KEY, blob, groups_blob, save_flat  # imports DCP: only when saving

    sd = sharded_state_dict(zero)
    extra = {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups],
        "loss_scaler": zero.scaler.state_dict(),
    }
    sd["zero/extra"] = blob(pickle.dumps(extra))
    sd[GROUPS_KEY] = groups_blob(zero.optimizer.param_groups)  # what every other reader of the format reads
    entries = {f"model/{n}": e for n, e in sharded_entries(zero).items()}
    save_flat(path, sd, entries, _dcp_rank())


@_collective("load_sharded", _on_world)
def load_sharded(zero: ZeroOptimizer, path: str, *, strict: bool = True):
    """Read the chunks overlapping this rank's slices from a :func:`save_sharded` checkpoint (any
    world size and stage; also one written by the ``colossalai`` Booster). Collective over the
    default group ([Note: state is collective]).

    Strict like ``load_state_dict``: one :class:`~colossal.comm.checkpoint.CheckpointMismatchError`
    (a ``ValueError``) lists every missing, unexpected and mis-shaped entry with shapes, on every
    rank, before anything changes; with ``strict=False`` missing entries stay as they are,
    unexpected ones are ignored, and both come back as
    :class:`~colossal.comm.checkpoint.IncompatibleEntries` (a mis-shaped entry is always an error).
    Every file is verified (size, CRC-32) before it is read: a truncated or corrupted one raises
    :class:`~colossal.comm.checkpoint.CheckpointError` naming it.
    """
    from colossal.comm.checkpoint import GROUPS_KEY, open_flat, read_blob

    expected = {f"model/{n}": e for n, e in sharded_entries(zero).items()}
    reader, found = open_flat(path, expected, with_optimizer=True, strict=strict)
    if "zero/extra" in reader.metadata:  # read (and verified) before anything changes
        extra = pickle.loads(read_blob(reader, "zero/extra"))
    else:  # a Booster checkpoint: hyperparameters only, the scaler stays
        extra = {"param_groups": pickle.loads(read_blob(reader, GROUPS_KEY))}
    saved_groups = extra["param_groups"]
    if len(saved_groups) != len(zero.optimizer.param_groups):
        have = len(zero.optimizer.param_groups)
        raise ValueError(f"the checkpoint {path!r} has {len(saved_groups)} param groups, the optimizer {have}")
    skip = {k[len("model/") :] for k in reader.skip}
    load_sharded_state_dict(zero, reader.metadata, reader.load, skip=skip)
    for g, sg in zip(zero.optimizer.param_groups, saved_groups, strict=True):
        g.update({k: v for k, v in sg.items() if k != "params"})
    if "loss_scaler" in extra:
        zero.scaler.load_state_dict(extra["loss_scaler"])
    return found


def _wanted(zero: ZeroOptimizer, metadata, chunks: dict, include_optimizer: bool) -> set[str]:
    """Keys of the pieces overlapping this rank's slices (and of its scalars and whole entries)."""
    wanted: set[str] = set()
    managed = {id(p) for flat in zero.flats for p in flat.params}
    for flat in zero.flats:
        opt = include_optimizer and flat.master is not None
        for s in flat.slices():
            lo, hi = s.param_start, s.param_start + s.numel
            for prefix in _prefixes(flat.names[s.index], chunks, opt):
                wanted.update(k for st, n, k in chunks[prefix] if st < hi and lo < st + n)
        if opt:
            heads = tuple(f"optim/{name}/" for name in flat.names)
            wanted.update(k for k in metadata if k.startswith(heads) and "@" not in k)
    for name, t in _unmanaged(zero, managed):
        wanted.update(k for *_, k in chunks.get(f"model/{name}", ()))
        if t.dim() == 0 and f"model/{name}" in metadata:
            wanted.add(f"model/{name}")
    return wanted


def load_sharded_state_dict(
    zero: ZeroOptimizer, metadata, load, *, include_optimizer: bool = True, skip: set[str] = frozenset()
) -> None:
    """Load the pieces overlapping this rank's slices. ``metadata``: the checkpoint's DCP
    ``state_dict_metadata`` (key -> sizes); ``load(tensors)``: fills a dict of tensors with the
    checkpoint's values in place (one ``dcp.load``; collective, every rank calls it once).
    ``skip``: entry names the checkpoint lacks that stay as they are (a non-strict load);
    every other entry must be complete (ValueError before anything changes)."""
    from colossal.comm.checkpoint import piece_index

    chunks = piece_index(metadata)
    _check_complete(zero, chunks, metadata, skip)
    wanted = _wanted(zero, metadata, chunks, include_optimizer)
    loaded = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in sorted(wanted)}
    load(loaded)
    managed = {id(p) for flat in zero.flats for p in flat.params}
    for flat in zero.flats:
        _values(flat).copy_(_assemble(flat, "model/{}", chunks, loaded, _values(flat)))
        if include_optimizer and flat.master is not None:
            _load_flat_state(zero, flat, chunks, loaded, skip)
    with torch.no_grad():
        for name, t in _unmanaged(zero, managed):
            if t.dim() == 0 and f"model/{name}" in loaded:
                t.copy_(loaded[f"model/{name}"])
            elif chunks.get(f"model/{name}"):  # a 1-element @0 piece from older checkpoints too
                full = torch.zeros(t.numel(), dtype=t.dtype)
                for start, n, key in chunks[f"model/{name}"]:
                    full[start : start + n] = loaded[key]
                t.copy_(full.view(t.shape))
    _publish(zero)


def _check_complete(zero: ZeroOptimizer, chunks: dict, metadata, skip) -> None:
    """ValueError when the pieces of a parameter (or of its states) do not add up to it, or a buffer
    is absent. Every rank knows every parameter's size, so all raise alike, before the collective load."""
    for flat in zero.flats:
        for name, numel in zip(flat.names, flat.numels, strict=True):
            for prefix in {f"model/{name}", *_prefixes(name, chunks)}:
                held = sum(n for _, n, _ in chunks.get(prefix, ()))
                if held != numel and not (held == 0 and name in skip):
                    raise ValueError(f"the checkpoint holds {held} of the {numel} elements of {prefix!r}")
    managed = {id(p) for flat in zero.flats for p in flat.params}
    for name, t in _unmanaged(zero, managed):
        whole = t.numel() if f"model/{name}" in metadata else 0  # a 0-dim tensor under its plain key
        held = sum(n for _, n, _ in chunks.get(f"model/{name}", ())) or whole
        if held != t.numel() and not (held == 0 and name in skip):
            raise ValueError(f"the checkpoint holds {held} of the {t.numel()} elements of 'model/{name}'")


def _prefixes(name: str, chunks: dict, include_optimizer: bool = True) -> list[str]:
    return [p for p in chunks if p == f"model/{name}" or (include_optimizer and p.startswith(f"optim/{name}/"))]


def _assemble(flat: FlatParam, pattern: str, chunks: dict, loaded: dict, base=None) -> torch.Tensor:
    """This rank's ``(shard_numel,)`` buffer filled from the overlapping saved chunks (elements
    no chunk covers keep ``base``'s values, or zero)."""
    out = torch.zeros(flat.shard_numel, dtype=torch.float32)
    if base is not None:
        out.copy_(base.detach())
    for s in flat.slices():
        lo, hi = s.param_start, s.param_start + s.numel
        for start, n, key in chunks.get(pattern.format(flat.names[s.index]), []):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out[s.shard_start + a - lo : s.shard_start + b - lo] = loaded[key][a - start : b - start]
    return out


def _load_flat_state(zero: ZeroOptimizer, flat: FlatParam, chunks: dict, loaded: dict, skip) -> None:
    """``flat``'s optimizer state from the loaded pieces: a parameter the checkpoint holds no state
    for is left without state, as ``torch.optim`` loads it (``[Note: one optimizer-state path]``);
    one a non-strict load skips (``skip``) keeps what it had."""
    held = []  # per parameter: the per-element and the scalar state keys the checkpoint has
    for n in flat.names:
        head = f"optim/{n}/"
        per = {p[len(head) :] for p in chunks if p.startswith(head)}
        held.append((per, {k[len(head) :] for k in loaded if k.startswith(head) and "@" not in k}))
    if not any(per or sc for per, sc in held):
        return
    elementwise = sorted(set().union(*(per for per, _ in held)))
    current, before = zero._flat_state(flat), zero._param_states(flat)
    base = {k: current[k] if _is_shard(flat, current.get(k)) else None for k in elementwise}
    state = {k: _assemble(flat, f"optim/{{}}/{k}", chunks, loaded, base[k]).to(flat.master.device) for k in elementwise}
    scalars = [
        before[i] if n in skip else {k: loaded[f"optim/{n}/{k}"].clone() for k in sc} if per or sc else None
        for i, (n, (per, sc)) in enumerate(zip(flat.names, held, strict=True))
    ]
    zero._set_param_states(flat, state, scalars)
