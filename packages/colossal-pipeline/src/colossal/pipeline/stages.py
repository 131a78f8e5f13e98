"""Split a model whose body is a sequence of blocks into pipeline chunks.

A model is seen as three parts: what its forward runs before the block container (embeddings)
goes with the first chunk, the blocks are divided among the ``p * v`` chunks, what it runs after
(final norm, head) goes with the last chunk (``[Note: the user's forward, cut at the blocks]`` in
:mod:`colossal.pipeline.forward_split`; a forward that cannot be cut is split by the order in
which the model registers its children). Each rank keeps real tensors only for what its own chunks use and
turns the rest into ``meta`` tensors, so a model built on the meta device is never whole anywhere.

[Note: same initial values as a dense build]
A model built on the meta device is initialised rank by rank, yet every rank must end with the
values a dense build from the same seed would give its tensors, and no rank may hold the whole
model. The rule: initialisation runs in the dense build's order over the whole model on every
rank, drawing from the same random stream; a tensor of this rank's stages is drawn in place, one
of another stage is drawn into a throw-away tensor (one module, or one parameter, at a time) and
dropped. The stream therefore advances exactly as in the dense build, so each kept tensor gets
its dense value, at the cost of drawing (not keeping) the other stages' numbers. Per module,
``reset_parameters()`` in ``model.modules()`` order is the dense ``to_empty`` + ``reset_parameters``
build (:func:`materialize_owned` with ``init=None``); a model with its own whole-model
initialiser applies the same rule itself (``colossalai``'s ``GPT.init_weights`` draws a meta
parameter into a scratch tensor).

[Note: per-micro-batch extras]
A block of a model such as a Hugging Face decoder takes more than the hidden state: the padding
mask, the position ids, rotary angles. ``PipelineParallel.step(..., extras={...})`` takes such
tensors for the whole batch (each with the batch's rows); the runtime cuts them into the same
micro-batches as the inputs, and every chunk of micro-batch ``i`` (on every rank, not just the
first: every rank is handed the whole batch) calls ``embed(model, x, extras_i)``,
``block_call(block, x, extras_i)`` and ``head(model, x, extras_i)``. Only the hidden state crosses
stages; ``extras_i`` is a fresh dict per micro-batch, so a caller may keep values derived from it
(a 4-D attention mask built once per chunk) in it under its own keys. Without ``extras`` the calls
are the two-argument ``embed(model, x)``, ``block(x)``, ``head(model, x)``.

[Note: tied embeddings]
A tensor registered both before and after the blocks (GPT's ``wte.weight`` is ``lm_head.weight``)
is one logical weight used by the first and the last chunk. When those live on different ranks,
each keeps its own copy (still tied under both names locally, so checkpoints see one tensor); the
runtime makes the copies equal at setup (the first rank's value wins) and sums their gradients
over the two ranks after every step (the "embedding group" of Megatron-LM), so both copies take
the same optimizer step and stay equal.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from colossal.comm import mark_unset, unset_names
from colossal.pipeline.forward_split import ForwardSplit, split_forward

__all__ = [
    "BLOCK_CANDIDATES",
    "BlockCost",
    "StageChunk",
    "check_initialised",
    "find_blocks",
    "materialize_owned",
    "measure_block_costs",
    "partition_blocks",
    "split_model",
]

BLOCK_CANDIDATES = ("blocks", "layers", "h", "transformer.h", "model.layers", "decoder.layers", "encoder.layer")
"""Names tried, in order, when no block sequence is named."""


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.Module]:
    """The block sequence of ``model``: ``(name, container)``, an ``nn.ModuleList``/``nn.Sequential``.

    With ``blocks`` given, that submodule; otherwise the first of :data:`BLOCK_CANDIDATES` found.
    """
    names = (blocks,) if blocks is not None else BLOCK_CANDIDATES
    for name in names:
        mod = _get(model, name)
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
            return name, mod
        if blocks is not None:
            got = "nothing" if mod is None else f"a {type(mod).__name__}"
            raise ValueError(
                f"blocks={blocks!r} of {type(model).__name__} must name a non-empty nn.ModuleList or "
                f"nn.Sequential, found {got}"
            )
    raise ValueError(
        f"{type(model).__name__} has no block sequence: looked for a non-empty nn.ModuleList or nn.Sequential "
        f"at {', '.join(BLOCK_CANDIDATES)}; pass blocks='<name>'"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class BlockCost:
    """What one block cost in a traced forward."""

    time_s: float
    """Forward wall time in seconds."""
    activation_bytes: int
    """Bytes the block saved for its backward."""
    params: int
    """Number of parameter elements."""


def measure_block_costs(model: nn.Module, *args, blocks: str | None = None, **kwargs) -> list[BlockCost]:
    """Run ``model(*args, **kwargs)`` once (with autograd on) and time each block's forward and
    count the bytes it saves for backward."""
    _, seq = find_blocks(model, blocks)
    costs: list[list[float]] = [[0.0, 0, 0] for _ in seq]
    current: list[int | None] = [None]
    hooks = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            costs[current[0]][1] += t.numel() * t.element_size()
        return t

    for i, blk in enumerate(seq):

        def pre(_m, _a, i=i):
            current[0] = i
            costs[i][0] -= time.perf_counter()

        def post(_m, _a, _o, i=i):
            costs[i][0] += time.perf_counter()
            current[0] = None

        hooks += [blk.register_forward_pre_hook(pre), blk.register_forward_hook(post)]
        costs[i][2] = sum(p.numel() for p in blk.parameters())
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [BlockCost(time_s=t, activation_bytes=int(a), params=int(n)) for t, a, n in costs]


def _balanced(weights: Sequence[float], k: int, first: float, last: float) -> list[int]:
    """Contiguous split of ``weights`` into ``k`` non-empty parts minimising the heaviest part
    (part 0 also carries ``first``, part ``k - 1`` also ``last``); returns the part sizes."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: lowest max over parts 0..j-1 covering weights[:i]; cut[j][i] where part j-1 starts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        extra = (first if j == 1 else 0.0) + (last if j == k else 0.0)
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                cand = max(best[j - 1][s], prefix[i] - prefix[s] + extra)
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, s
    sizes, i = [], n
    for j in range(k, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def partition_blocks(
    n_blocks: int,
    n_chunks: int,
    method: str = "uniform",
    *,
    weights: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
    first: float = 0.0,
    last: float = 0.0,
) -> list[tuple[int, int]]:
    """Block ranges ``[(lo, hi), ...]``, one per chunk.

    ``method``: ``"uniform"`` (equal counts; ``n_blocks`` must divide by ``n_chunks``),
    ``"params"`` or ``"cost"`` (contiguous parts balancing ``weights``, with the embedding's
    weight ``first`` on chunk 0 and the head's ``last`` on the last chunk), or ``"sizes"``
    (``sizes`` given explicitly, e.g. ``[3, 1, 2, 2]``).
    """
    if n_chunks > n_blocks:
        raise ValueError(f"{n_blocks} blocks cannot fill {n_chunks} chunks (pp * v); need at least one block each")
    if method == "uniform":
        if n_blocks % n_chunks:
            raise ValueError(
                f"{n_blocks} blocks are not divisible by pp * v = {n_chunks}; use partition='params', 'cost' "
                "or explicit sizes for an uneven split"
            )
        sizes = [n_blocks // n_chunks] * n_chunks
    elif method in ("params", "cost"):
        if weights is None or len(weights) != n_blocks:
            raise ValueError(f"partition {method!r} needs one weight per block ({n_blocks}), got {weights!r}")
        sizes = _balanced([float(w) for w in weights], n_chunks, float(first), float(last))
    elif method == "sizes":
        if sizes is None or len(sizes) != n_chunks or any(s < 1 for s in sizes) or sum(sizes) != n_blocks:
            raise ValueError(f"sizes must be {n_chunks} positive counts summing to {n_blocks} blocks, got {sizes!r}")
    else:
        raise ValueError(f"partition must be 'uniform', 'params', 'cost' or 'sizes', got {method!r}")
    bounds, lo = [], 0
    for s in sizes:
        bounds.append((lo, lo + int(s)))
        lo += int(s)
    return bounds


class StageChunk:
    """One chunk of the pipeline on this rank: blocks ``lo..hi-1`` of the model, plus the embedding
    (first chunk) or the head (last chunk). Calling it runs that part's forward."""

    def __init__(
        self,
        model: nn.Module,
        index: int,
        n_chunks: int,
        blocks: Sequence[nn.Module],
        embed: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        head: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        param_names: list[str],
        activation_checkpointing: bool = False,
        block_call: Callable[[nn.Module, torch.Tensor, dict], torch.Tensor] | None = None,
    ) -> None:
        self.model, self.index, self.blocks = model, index, list(blocks)
        self._block_call = block_call
        self.is_first, self.is_last = index == 0, index == n_chunks - 1
        self._embed, self._head = embed, head
        self.param_names = param_names
        """Original names (in the whole model) of the parameters this chunk uses."""
        self.activation_checkpointing = activation_checkpointing

    def __call__(self, x: torch.Tensor, extras: dict | None = None) -> torch.Tensor:
        """This chunk's forward; ``extras``: the micro-batch's extra inputs (``[Note: per-micro-batch
        extras]``), handed to ``embed``, ``block_call`` and ``head`` when given."""
        args = () if extras is None else (extras,)
        if self.is_first:
            x = self._embed(self.model, x, *args)
        for blk in self.blocks:
            call = blk if extras is None else functools.partial(self._block_call or _plain_block, blk)
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = _checkpoint(call, x, *args, use_reentrant=False)
            else:
                x = call(x, *args)
        if self.is_last:
            x = self._head(self.model, x, *args)
        return x

    def __repr__(self) -> str:
        return f"StageChunk({self.index}, blocks={len(self.blocks)}, first={self.is_first}, last={self.is_last})"


def _plain_block(block: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    """The default ``block_call``: the block of the hidden state alone."""
    return block(x)


def _sides(model: nn.Module, blocks_name: str) -> tuple[list[str], list[str]]:
    """Top-level children registered before and after the block container."""
    top = blocks_name.split(".")[0]
    names = [n for n, _ in model.named_children()]
    i = names.index(top)
    return names[:i], names[i + 1 :]


def _default_part(names: list[str], what: str, blocks_name: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    if "." in blocks_name:
        raise ValueError(
            f"blocks={blocks_name!r} is nested, so the {what} cannot be inferred; pass {what}=fn(model, x)"
        )

    def run(model: nn.Module, x: torch.Tensor, extras: dict | None = None) -> torch.Tensor:
        for n in names:
            x = getattr(model, n)(x)
        return x

    return run


def _default_parts(model: nn.Module, blocks: str, embed: Callable | None, head: Callable | None):
    """``embed``/``head`` where given, else the model's own forward around the blocks, else (a
    forward that cannot be cut) the top-level children before/after the blocks in registration
    order, refusing what that fallback would compute differently from the forward."""
    if embed is not None and head is not None:
        return embed, head  # the user says what the first and last stage compute
    cut = _cut(model, blocks)
    if cut.problem is None:
        return embed or cut.embed, head or cut.head
    missing = " and ".join(f"{w}=fn(model, x)" for w, f in (("embed", embed), ("head", head)) if f is None)
    if cut.in_blocks:
        raise ValueError(
            f"{cut.problem}; a pipeline stage runs its blocks one after another on the hidden state alone, so move "
            f"that code into the block (wrap each block in a module that does it), or pass {missing} and accept "
            "that the blocks run alone"
        )
    if cut.fatal:
        raise ValueError(f"{cut.problem}; pass {missing} for the pipeline's stages")
    root = _root_tensors(model)
    if root:
        raise ValueError(
            f"{type(model).__name__} registers {root} on the model itself, and its forward cannot be cut at the blocks "
            f"({cut.problem}), so no stage would read them; pass {missing} that use them"
        )
    before, after = _sides(model, blocks)
    return embed or _default_part(before, "embed", blocks), head or _default_part(after, "head", blocks)


def _owner(name: str, prefix: str, seen_blocks: bool) -> tuple[str, int]:
    """``("block", i)`` for a tensor of block ``i``; ``("first"|"last", -1)`` otherwise."""
    if name.startswith(prefix):
        return "block", int(name[len(prefix) :].split(".", 1)[0])
    return ("last" if seen_blocks else "first"), -1


def _cut(model: nn.Module, blocks_name: str) -> ForwardSplit:
    """The model's forward cut at its blocks (``[Note: the user's forward, cut at the blocks]``);
    a nested block container is never cut (its forward is the parent's business)."""
    if "." in blocks_name:
        return ForwardSplit(problem=f"blocks={blocks_name!r} is nested")
    return split_forward(model, blocks_name, len(find_blocks(model, blocks_name)[1]))


def tensor_owners(model: nn.Module, blocks_name: str) -> dict[str, tuple[str, int]]:
    """Every parameter and buffer name (tied ones under each name) -> its owning part: a block's
    tensors go with that block; the others with the part of the model's forward that reads them
    (``[Note: the user's forward, cut at the blocks]``); those no part reads (or all of them when
    the forward cannot be cut) with the first or last part by registration order."""
    prefix, owners, seen = blocks_name + ".", {}, False
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
    for name, _ in sorted(tensors, key=lambda nt: order.get(nt[0].rpartition(".")[0], -1)):
        seen = seen or name.startswith(prefix)
        owners[name] = _owner(name, prefix, seen)
    cut = _cut(model, blocks_name)
    if cut.problem is None:
        for name in cut.embed_tensors | cut.head_tensors:
            sides = [s for s, used in (("before", cut.embed_tensors), ("after", cut.head_tensors)) if name in used]
            if owners[name][0] == "block":
                raise NotImplementedError(
                    f"{type(model).__name__}.forward reads {name} (a tensor of block {owners[name][1]}) {sides[0]} "
                    "the blocks; a stage holds only its own blocks' tensors"
                )
            if len(sides) == 2:
                raise NotImplementedError(
                    f"{type(model).__name__}.forward reads {name} both before and after the blocks, so the first and "
                    "the last stage both need it; register it under two names (a tie, e.g. "
                    "lm_head.weight = wte.weight) or pass embed=/head="
                )
            owners[name] = ("first" if sides == ["before"] else "last", -1)
    return owners


def _root_tensors(model: nn.Module) -> list[str]:
    """Parameters and buffers registered on the model itself (not on a child)."""
    return [n for n, _ in list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False))]


def _replace(model: nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if is_param:
        mod._parameters[attr] = tensor
    else:
        mod._buffers[attr] = tensor


def materialize_owned(
    model: nn.Module, owned: set[str], device: torch.device, init: Callable | None, *, check: bool = True
) -> None:
    """Keep real tensors (on ``device``) for the names in ``owned``; make every other one ``meta``.

    A tensor registered under several names (tied) stays one tensor under all of them when any of
    its names is owned, so the model keeps its tie structure (and checkpoint aliases) on every
    rank. Tensors still on the meta device are initialised by ``init(module)`` for each module
    holding an owned one, or (``init=None``) as ``[Note: same initial values as a dense build]``
    says: the same values a dense ``to_empty`` + ``reset_parameters`` build would give them.

    Each tensor allocated here is marked first (``[Note: marking tensors a meta build leaves
    unset]`` in ``colossal.comm.meta``); with ``check`` a :class:`ValueError` names those that the
    initialisation left unset (a caller that initialises afterwards passes ``check=False`` and
    calls :func:`check_initialised` itself).
    """
    params = list(model.named_parameters(remove_duplicate=False))
    buffers = list(model.named_buffers(remove_duplicate=False))
    needs_init = any(t.is_meta for n, t in params + buffers if n in owned)
    if init is None and check and needs_init:  # alike on every rank of a meta build: a module without reset
        lost = [n for n, t in params + buffers if t.is_meta and not _resettable(model, n)]
        if lost:
            raise ValueError(
                f"meta-device model: {', '.join(lost)} would not be initialised (their modules have no "
                "reset_parameters(), and a meta tensor keeps no values: a buffer such as torch.ones(n) built under "
                "torch.device('meta') is lost); give those modules reset_parameters(), pass init=, or build the "
                "model on a real device"
            )
    keep_ids = {id(t) for n, t in params + buffers if n in owned}
    fresh_ids = {id(t) for _, t in params + buffers if t.is_meta}  # allocated here: to initialise
    made: dict[int, torch.Tensor] = {}
    for is_param, items in ((True, params), (False, buffers)):
        for name, t in items:
            if id(t) not in made:
                if id(t) in keep_ids:
                    new = torch.empty_like(t, device=device) if t.is_meta else t.detach().to(device)
                else:
                    new = torch.empty_like(t, device="meta")
                made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new
            _replace(model, name, made[id(t)], is_param)
    fresh = {id(made[i]) for i in fresh_ids & keep_ids}
    if not fresh:  # nothing of this rank was on the meta device: nothing to initialise (no draws)
        return
    mark_unset(made[i] for i in fresh_ids & keep_ids)
    with torch.no_grad():
        if init is not None:
            for mod in model.modules():
                if any(id(t) in fresh for t in _own_tensors(mod)):
                    init(mod)
        else:
            _replay_reset(model, fresh, device)
    if check:
        check_initialised(model, owned)


def _resettable(model: nn.Module, name: str) -> bool:
    """Whether the module holding tensor ``name`` has a ``reset_parameters()``."""
    return callable(getattr(model.get_submodule(name.rpartition(".")[0]), "reset_parameters", None))


def check_initialised(model: nn.Module, names: set[str]) -> None:
    """Raise a :class:`ValueError` naming the tensors among ``names`` that still hold the mark of
    :func:`materialize_owned` (no initialiser wrote them)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    unset = unset_names((n, t) for n, t in named if n in names)
    if unset:
        raise ValueError(
            f"meta-device model: {', '.join(unset)} not initialised by any reset_parameters() or the model's "
            "initialiser (a meta tensor keeps no values: a buffer such as torch.ones(n) built under "
            "torch.device('meta') is lost); give those modules reset_parameters(), pass init=, or build the "
            "model on a real device"
        )


def _own_tensors(mod: nn.Module) -> list[torch.Tensor]:
    return list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))


@torch.no_grad()
def _replay_reset(model: nn.Module, fresh: set[int], device: torch.device) -> None:
    """``reset_parameters()`` of every module in ``model.modules()`` order, as a dense build runs
    them: in place where the module's tensors are this rank's fresh ones, on a throw-away
    materialised copy where they are another stage's (meta), so the random stream advances
    exactly as in the dense build (``[Note: same initial values as a dense build]``)."""
    for mod in model.modules():
        reset = getattr(mod, "reset_parameters", None)
        own = _own_tensors(mod)
        if reset is None or not own:
            continue
        if all(id(t) in fresh for t in own):
            reset()
        elif all(t.is_meta for t in own):
            scratch = copy.deepcopy(mod).to_empty(device=device)  # one foreign module at a time
            scratch.reset_parameters()
            del scratch


def split_model(
    model: nn.Module,
    chunk_ids: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    *,
    blocks: str,
    embed: Callable | None = None,
    head: Callable | None = None,
    activation_checkpointing: bool = False,
    block_call: Callable | None = None,
) -> list[StageChunk]:
    """The :class:`StageChunk` objects of ``chunk_ids`` (global indices into ``bounds``);
    ``block_call(block, x, extras)`` runs one block when a step has extras (default ``block(x)``).

    Only builds the views; :func:`materialize_owned` decides which tensors stay real.
    """
    _, seq = find_blocks(model, blocks)
    if embed is None or head is None:
        embed, head = _default_parts(model, blocks, embed, head)
    owners = tensor_owners(model, blocks)
    chunks = []
    for c in chunk_ids:
        lo, hi = bounds[c]
        mine = {"block"} | ({"first"} if c == 0 else set()) | ({"last"} if c == len(bounds) - 1 else set())
        names = [n for n, (part, i) in owners.items() if part in mine and (part != "block" or lo <= i < hi)]
        chunks.append(
            StageChunk(
                model,
                c,
                len(bounds),
                [seq[i] for i in range(lo, hi)],
                embed,
                head,
                names,
                activation_checkpointing,
                block_call,
            )  # fmt: skip
        )
    return chunks
