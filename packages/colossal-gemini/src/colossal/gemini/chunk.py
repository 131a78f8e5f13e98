"""One chunk: a fixed-size flat buffer holding several parameters, and the states that guard it.

Parameters are packed into chunks in the order they are used; each parameter's ``.data`` is a
view into its chunk's ``payload``. Chunks are the unit of placement, movement and communication.

[Note: freeing a chunk without breaking autograd]
Autograd saves parameters for backward by reference, i.e. it keeps views of ``payload``. So the
payload tensor is allocated once and never replaced: releasing the chunk resizes its *storage*
to 0 bytes (the memory is returned, every view stays valid as an object), and fetching it resizes
the storage back and copies the data in. Saved views therefore see the right data in backward, as
long as the chunk is fetched before the backward of the module that uses it (the pre-backward
hook does that). FSDP1 and Colossal-AI use the same trick.

Per rank a chunk holds (``S`` = chunk elements, ``N`` = data-parallel ranks):

* ``payload`` ``(S,)`` working precision, on the compute device, materialised only while GATHERED;
* ``shard`` ``(S/N,)`` working precision, this rank's slice, on ``w_tier`` (for ``N == 1`` and the
  device tier it *is* ``payload``);
* ``grad_buffer`` ``(S,)`` working precision on the device, only from the first gradient of a
  backward pass until the chunk is reduced;
* ``master`` and ``grad_shard`` ``(S/N,)`` fp32 on ``o_tier`` (with the optimizer states).

[Note: frozen chunks]
Parameters that do not require grad (a frozen base under LoRA) are packed into chunks of their own
(``Chunk.frozen``; a chunk never mixes frozen and trainable parameters). A frozen chunk is only its
working data: no fp32 master, no gradient shard or buffer, no optimizer states, never reduced, never
stepped, so the working shard is the only copy of its values (in bf16 under bf16 mixed precision: 2
bytes per parameter instead of 16). It is fetched, gathered, released and evicted like any chunk;
with a disk tier its disk region stays clean (nothing writes the values), so an eviction to disk
writes nothing after the first time. State dicts read and write its working shard
(``ChunkManager.read_working`` / ``write_working``) where they would read and write a master. Its
tensors leave HOLD_AFTER_BWD at the end of backward through :meth:`Chunk.after_frozen_backward`
(no gradient ever moves them to READY_FOR_REDUCE).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = ["TensorState", "ChunkState", "TensorInfo", "Chunk", "IllegalTransitionError"]


class IllegalTransitionError(RuntimeError):
    """A tensor or chunk was asked to move to a state it cannot reach from where it is."""


class TensorState(enum.Enum):
    """Where one parameter is in the iteration (driven by the forward/backward hooks)."""

    FREE = "free"
    """Its chunk is not materialised on the compute device: it must be fetched before use."""
    HOLD = "hold"
    """Materialised and idle: the chunk may be released or moved."""
    COMPUTE = "compute"
    """In use by an operator (forward or backward): its chunk may not be released or moved."""
    HOLD_AFTER_BWD = "hold_after_bwd"
    """Its module's backward operator has begun but its gradient has not been accumulated yet: autograd
    may still read it (a parent module's operator can begin before a child's backward has run), so its
    chunk stays on the device while autograd still holds saved views of the chunk (``Chunk.saved``)."""
    READY_FOR_REDUCE = "ready_for_reduce"
    """Its gradient is in the chunk's gradient buffer; the chunk is reduced once all its tensors are here."""


_LEGAL: dict[TensorState, frozenset[TensorState]] = {
    TensorState.FREE: frozenset({TensorState.HOLD, TensorState.READY_FOR_REDUCE}),
    TensorState.HOLD: frozenset({TensorState.FREE, TensorState.COMPUTE, TensorState.READY_FOR_REDUCE}),
    TensorState.COMPUTE: frozenset({TensorState.HOLD, TensorState.HOLD_AFTER_BWD, TensorState.READY_FOR_REDUCE}),
    TensorState.HOLD_AFTER_BWD: frozenset({TensorState.COMPUTE, TensorState.READY_FOR_REDUCE}),
    # -> COMPUTE: a module that shares the tensor begins its backward after the gradient came in (a reentrant
    # recomputation: each inner backward accumulates its own part; see [Note: shared parameters] in ddp.py)
    TensorState.READY_FOR_REDUCE: frozenset({TensorState.HOLD, TensorState.FREE, TensorState.COMPUTE}),
}


_BUSY = (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD)
# the same table as tuples keyed by the member's value: membership by identity and a str hash, no
# Enum.__hash__ (the gradient hooks check a transition per parameter per step)
_ALLOWED: dict[str, tuple[TensorState, ...]] = {s.value: tuple(t) for s, t in _LEGAL.items()}
_READY = TensorState.READY_FOR_REDUCE


class ChunkState(enum.Enum):
    """What memory of the chunk is materialised on the compute device."""

    RELEASED = "released"
    """``payload`` storage is freed; only this rank's shard exists (on its tier)."""
    GATHERED = "gathered"
    """``payload`` holds the whole chunk on the compute device: its parameters can be computed with."""


@dataclasses.dataclass(slots=True)
class TensorInfo:
    """A parameter's slot in its chunk."""

    param: torch.nn.Parameter
    """The parameter; its ``.data`` is ``payload[offset:offset + numel].view(shape)``."""
    name: str
    """Its (first) name in the model."""
    offset: int
    """First element in the chunk."""
    numel: int
    """Number of elements."""
    state: TensorState = TensorState.FREE
    """Current state."""
    users: int = 0
    """Forward operators using the tensor now (COMPUTE only): more than one when modules that share it
    run nested, e.g. a parent and its child (see ``[Note: shared parameters]`` in ``ddp.py``)."""
    grads: int = 0
    """Gradients accumulated into its slot of the gradient buffer since the chunk was last reduced (more
    than one when a shared parameter's uses reach it through separate backward passes)."""


class Chunk:
    """A flat buffer of ``size`` elements shared by several parameters (see the module docstring)."""

    def __init__(
        self, chunk_id: int, size: int, dtype: torch.dtype, device: torch.device, world_size: int, frozen: bool = False
    ):
        if size % world_size:
            raise ValueError(f"chunk size {size} must be divisible by the data-parallel size {world_size}")
        self.id = chunk_id
        self.size = size
        self.shard_size = size // world_size
        self.dtype = dtype
        self.world_size = world_size
        self.frozen = frozen  # parameters without gradients only: working data alone ([Note: frozen chunks])
        self.tensors: list[TensorInfo] = []
        self.used = 0  # elements taken by tensors; the rest is padding
        self.payload = torch.empty(size, dtype=dtype, device=device)
        self.payload.untyped_storage().resize_(0)
        self.state = ChunkState.RELEASED
        self.shard: torch.Tensor | None = None
        self.w_tier = "host"  # tier name of `shard`
        self.grad_buffer: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.o_tier = "host"  # tier name of master, grad_shard and the optimizer states
        self.has_grad = False  # grad_shard holds gradients not yet consumed by a step
        self.written: set[int] = set()  # offsets of tensors whose gradient went straight to grad_shard this pass
        self.got_grad: set[int] = set()  # offsets of tensors given a gradient since the last step (any pass)
        self.pending = None  # async reduce-scatter handle
        self.gather_handle = None  # async all-gather (prefetch) still writing into payload
        self.states_accounted = False  # optimizer states charged to o_tier (after the first step)
        self.pins = 0  # modules recomputing their forward inside backward (activation checkpointing)
        self.saved = 0  # live views of the payload saved by autograd (GeminiDDP's saved-tensor hooks)
        self.n_ready = 0  # tensors in READY_FOR_REDUCE (kept by transition(): ready_for_reduce without a scan)
        self.on_disk: set[str] = set()  # parts of the optimizer block on the disk tier: master, grad, states
        self.disk_clean = False  # the disk region of the working shard holds the current working data
        self.disk_read = None  # a running read of the working shard from disk (prefetch)

    # -- packing ---------------------------------------------------------------------------------
    def can_fit(self, numel: int) -> bool:
        """Whether ``numel`` more elements fit."""
        return self.used + numel <= self.size

    def append(self, param: torch.nn.Parameter, name: str) -> TensorInfo:
        """Reserve the next slot for ``param`` (its data is bound later by :meth:`bind`)."""
        if not self.can_fit(param.numel()):
            raise ValueError(f"chunk {self.id}: {param.numel()} elements do not fit in {self.size - self.used} left")
        info = TensorInfo(param=param, name=name, offset=self.used, numel=param.numel())
        self.tensors.append(info)
        self.used += param.numel()
        return info

    def bind(self) -> None:
        """Point every parameter's ``.data`` at its slot in ``payload``."""
        for info in self.tensors:
            view = self.payload[info.offset : info.offset + info.numel].view(info.param.shape)
            if info.param.is_meta:  # meta -> real cannot go through set_data: swap, keeping the object
                real = torch.nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device))
                torch.utils.swap_tensors(info.param, real)
            info.param.data = view  # set_data: the parameter keeps its own version counter

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of ``rank``'s shard in the chunk."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    # -- states ----------------------------------------------------------------------------------
    def transition(self, info: TensorInfo, target: TensorState) -> None:
        """Move one tensor to ``target``, refusing transitions the state machine does not allow."""
        state = info.state
        if target not in _ALLOWED[state._value_]:
            raise IllegalTransitionError(
                f"tensor {info.name!r} in chunk {self.id}: cannot go from {state.name} to {target.name}; "
                f"allowed from {state.name}: {sorted(s.name for s in _LEGAL[state])}"
            )
        if target is not TensorState.COMPUTE:
            info.users = 0
        if target is _READY:
            self.n_ready += 1
        elif state is _READY:
            self.n_ready -= 1
        info.state = target

    def enter(self, info: TensorInfo) -> None:
        """One more operator computes with ``info``: -> COMPUTE, or one more user of a tensor already in
        COMPUTE (a module nested in another that uses the same parameter)."""
        if info.state is TensorState.COMPUTE:
            info.users += 1
            return
        self.transition(info, TensorState.COMPUTE)
        info.users = 1

    def leave(self, info: TensorInfo, target: TensorState) -> None:
        """An operator is done with ``info``; the last of its users moves it to ``target``."""
        if info.state is not TensorState.COMPUTE or info.users < 1:
            raise IllegalTransitionError(
                f"tensor {info.name!r} in chunk {self.id}: left by an operator while {info.state.name} "
                f"with {info.users} users; expected COMPUTE with at least 1"
            )
        info.users -= 1
        if info.users == 0:
            self.transition(info, target)

    def count(self, state: TensorState) -> int:
        """Number of tensors in ``state``."""
        return sum(info.state is state for info in self.tensors)

    @property
    def in_use(self) -> bool:
        """True while any tensor is in COMPUTE, or in HOLD_AFTER_BWD while autograd still holds saved views
        of the chunk (backward ops of a begun operator may still read them), or the chunk is pinned by a
        recomputation: the chunk can be neither released nor moved."""
        if self.pins > 0:
            return True
        busy = _BUSY if self.saved else (TensorState.COMPUTE,)
        return any(info.state in busy for info in self.tensors)

    @property
    def ready_for_reduce(self) -> bool:
        """True when every tensor's gradient is in the gradient buffer."""
        return self.n_ready == len(self.tensors)

    def to_gathered(self) -> None:
        """RELEASED -> GATHERED (the caller has filled ``payload``); FREE tensors become HOLD."""
        if self.state is not ChunkState.RELEASED:
            raise IllegalTransitionError(f"chunk {self.id}: to_gathered from {self.state.name}, expected RELEASED")
        self.state = ChunkState.GATHERED
        for info in self.tensors:
            if info.state is TensorState.FREE:
                info.state = TensorState.HOLD

    def to_released(self) -> None:
        """GATHERED -> RELEASED (the caller frees ``payload``); HOLD tensors become FREE."""
        if self.state is not ChunkState.GATHERED:
            raise IllegalTransitionError(f"chunk {self.id}: to_released from {self.state.name}, expected GATHERED")
        if self.in_use:
            busy = [i.name for i in self.tensors if i.state in _BUSY]
            raise IllegalTransitionError(
                f"chunk {self.id}: cannot release while tensors {busy} are in COMPUTE/HOLD_AFTER_BWD (pins {self.pins})"
            )
        self.state = ChunkState.RELEASED
        for info in self.tensors:
            if info.state is TensorState.HOLD:
                info.state = TensorState.FREE

    def after_reduce(self) -> None:
        """READY_FOR_REDUCE -> HOLD (or FREE when the chunk is released) for every tensor."""
        target = TensorState.HOLD if self.state is ChunkState.GATHERED else TensorState.FREE
        for info in self.tensors:
            self.transition(info, target)
            info.grads = 0

    def after_frozen_backward(self) -> None:
        """End of backward for a frozen chunk ([Note: frozen chunks]): every tensor its backward operators
        left (HOLD_AFTER_BWD) goes back to HOLD, or FREE when the chunk is released."""
        if not self.frozen:
            raise IllegalTransitionError(f"chunk {self.id}: after_frozen_backward on a chunk with gradients")
        target = TensorState.HOLD if self.state is ChunkState.GATHERED else TensorState.FREE
        for info in self.tensors:
            if info.state is TensorState.HOLD_AFTER_BWD:
                info.state = target

    @property
    def nbytes(self) -> int:
        """Bytes of the whole chunk in working precision."""
        return self.size * self.payload.element_size()

    @property
    def shard_nbytes(self) -> int:
        """Bytes of this rank's working-precision shard."""
        return self.shard_size * self.payload.element_size()

    def __repr__(self) -> str:
        return (
            f"Chunk(id={self.id}, size={self.size}, tensors={len(self.tensors)}, state={self.state.name}, "
            f"w_tier={self.w_tier}, o_tier={self.o_tier})"
        )
