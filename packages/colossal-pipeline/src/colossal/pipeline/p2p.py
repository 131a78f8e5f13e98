"""Activations and gradients between neighbouring chunks, through ``colossal.comm.batch_p2p``.

[Note: shapes agreed once]
The receiver of an activation must allocate its buffer before the data arrives. The first time a
chunk boundary is crossed for a given input signature (shape and dtype of the user's batch and
the micro-batch count), the sender puts a small int64 header (dtype code, rank, dims) in front of
the data; the receiver reads it, allocates, and remembers the result. Every later micro-batch and
step with the same signature receives straight into a fresh buffer, posted ahead of time.
Gradients need no header: the gradient of a chunk's output has the output's shape, which the
receiving rank produced itself.

[Note: p2p order on NCCL]
On gloo every send and receive is an independent asynchronous operation, so the executor posts
each receive one compute ahead and lets sends complete at the end of the step ("overlap" mode).
NCCL runs the point-to-point operations of a communicator in issue order on one stream, and a
receive blocks that stream until the peer's matching send runs: two neighbours that each post a
receive before their send (1F1B's steady state: a forward activation one way, a gradient the other)
wait for each other forever. NCCL requires that matching operations be issued in the same order
on both sides and that a send and a receive that must progress together be in one group. So the
"grouped" mode (every backend but gloo, or ``PipelineConfig(p2p="grouped")``) issues exactly one
``batch_p2p`` per exchange point (before each compute and after the last): the sends of the
compute just done and the receives of the compute about to run, sorted by :func:`wire_key`, the
same key on both sides of every message (headers before data). A receive whose shape is not known
yet goes as its header in that group and its data in a group of its own right after. Tests check
on every schedule, over a grid of ``(p, m, v)``, that each directed pair of ranks issues its sends
and its receives in the same order and that the groups, run with NCCL's blocking semantics
(:func:`colossal.pipeline.simulate.simulate_groups`), never deadlock.

[Note: releasing sends on gloo]
A sent tensor stays alive until its send is waited. Gloo's send reports itself completed only once
``wait()`` was called (``is_completed()`` stays ``False`` after the peer has the data), and
waiting a send whose receive the peer has not posted blocks on that peer. So the overlap mode
waits each send at the first point where it is *known* to be done: after this rank has received a
message that the peer sent only after it had received ours. The peer waits its receives before
the compute that consumes them and issues its sends after, so in its program the receive of our
message ``s`` at step ``i`` precedes every send of steps ``>= i``; the first of those to reach us,
at our step ``j``, releases ``s`` once step ``j``'s receives are in. :func:`send_release_points`
computes this from the schedule at setup. An activation is released right before its own
backward (the output was held for it anyway); a gradient when the next activation from that
peer comes in. Sends with no such message are waited at the end of the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from colossal import comm as cc
from colossal.pipeline.schedules import Action, ActionKind, Schedule

__all__ = [
    "StageLinks",
    "P2P_TAG",
    "HEADER_TAG",
    "Wire",
    "exchange_blocks",
    "exchange_groups",
    "send_release_points",
    "split_steps",
    "wire_key",
]

P2P_TAG = "colossal.pipeline.p2p"
"""Tag of every activation/gradient transfer's :class:`~colossal.comm.CommEvent`."""
HEADER_TAG = "colossal.pipeline.shape"
"""Tag of the shape headers (first step of a signature only)."""

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


def wire_key(a: Action, header: bool = False) -> tuple[int, int, int, int]:
    """The order of a transfer inside a group, the same on its sending and its receiving side:
    ``(header first, direction, micro-batch, sending chunk)``."""
    K = ActionKind
    backward = a.kind in (K.SEND_B, K.RECV_B)
    sender = {K.SEND_F: a.chunk, K.SEND_B: a.chunk, K.RECV_F: a.chunk - 1, K.RECV_B: a.chunk + 1}[a.kind]
    return (0 if header else 1, int(backward), a.mb, sender)


class Wire(NamedTuple):
    """One point-to-point operation of the grouped mode, seen from the rank issuing it."""

    send: bool
    peer: int
    key: tuple[int, int, int, int]
    """:func:`wire_key`: which message (and whether its header) this is."""


def _peer_of(schedule: Schedule, a: Action) -> int:
    step = 1 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else -1
    return schedule.rank_of(a.chunk + step)


def exchange_blocks(computes: list[ActionKind], paired: bool) -> list[list[int]]:
    """Indices of a rank's computes cut into blocks, one exchange point before each block and one
    after the last: every compute on its own, or (``paired``) a forward followed by a backward
    in one block, as Megatron-LM's interleaved schedule pairs them."""
    blocks, k = [], 0
    while k < len(computes):
        pair = paired and computes[k] == ActionKind.F and k + 1 < len(computes)
        if pair and computes[k + 1] in (ActionKind.B, ActionKind.BI):
            blocks.append([k, k + 1])
            k += 2
        else:
            blocks.append([k])
            k += 1
    return blocks


def split_steps(actions: Iterable[Action]) -> list[tuple[list[Action], Action, list[Action]]]:
    """A rank's program as ``(receives, compute, sends)`` per compute."""
    steps: list[tuple[list[Action], Action, list[Action]]] = []
    recvs: list[Action] = []
    for a in actions:
        if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            recvs.append(a)
        elif a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            steps[-1][2].append(a)
        else:
            steps.append((recvs, a, []))
            recvs = []
    return steps


def exchange_groups(schedule: Schedule, rank: int, headers: bool = False, paired: bool = False) -> list[list[Wire]]:
    """The ``batch_p2p`` groups of ``rank`` in grouped mode, in issue order (``[Note: p2p order on
    NCCL]``): at each exchange point of :func:`exchange_blocks` the sends of the block just run
    and the receives of the next (empty groups left out). With ``headers`` (the first step of a
    signature) the first activation over each chunk boundary has its header ahead of its data,
    and its data receive in a group of its own. This is what :meth:`StageLinks.exchange` issues."""
    steps = split_steps(schedule.actions(rank))
    blocks = exchange_blocks([c.kind for _, c, _ in steps], paired)
    seen: set[tuple[ActionKind, int]] = set()  # (kind, chunk) transferred once: its shape is known

    def wires(actions: list[Action]) -> tuple[list[Wire], list[Wire]]:
        now, late = [], []
        for a in actions:
            peer, send = _peer_of(schedule, a), a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)
            first = (a.kind, a.chunk) not in seen
            seen.add((a.kind, a.chunk))
            if headers and first and a.kind in (ActionKind.SEND_F, ActionKind.RECV_F):
                now.append(Wire(send, peer, wire_key(a, header=True)))
                (now if send else late).append(Wire(send, peer, wire_key(a)))
            else:
                now.append(Wire(send, peer, wire_key(a)))
        return now, late

    groups: list[list[Wire]] = []
    pending: list[Action] = []
    for block in [*blocks, []]:
        now, late = wires(pending + [a for j in block for a in steps[j][0]])
        groups += [sorted(g, key=lambda w: w.key) for g in (now, late) if g]
        pending = [a for j in block for a in steps[j][2]]
    return groups


def _message(a: Action) -> tuple[int, int, int]:
    """The message a transfer carries, the same on its two sides: ``(backward, mb, sending chunk)``."""
    return wire_key(a)[1:]


def send_release_points(schedule: Schedule, rank: int) -> list[list[Action]]:
    """For each compute step of ``rank`` (:func:`split_steps` order), the sends that are known to
    be complete once that step's receives have arrived (``[Note: releasing sends on gloo]``).
    Sends in no list are completed at the end of the step."""
    steps = {q: split_steps(schedule.actions(q)) for q in range(schedule.p)}
    recv_at: dict[int, dict[tuple, int]] = {q: {} for q in steps}  # rank -> message -> step receiving it
    sent_by: dict[int, list[tuple[int, int, tuple]]] = {q: [] for q in steps}  # rank -> (step, peer, message)
    for q, prog in steps.items():
        for i, (recvs, _, sends) in enumerate(prog):
            recv_at[q].update((_message(a), i) for a in recvs)
            sent_by[q] += [(i, _peer_of(schedule, a), _message(a)) for a in sends]
    release: list[list[Action]] = [[] for _ in steps[rank]]
    for _, _, sends in steps[rank]:
        for a in sends:
            q = _peer_of(schedule, a)
            consumed = recv_at[q][_message(a)]  # the peer's step that waits for our message
            later = [recv_at[rank][m] for i, peer, m in sent_by[q] if peer == rank and i >= consumed]
            if later:
                release[min(later)].append(a)
    return release


def _sorted_ops(entries: Iterable[tuple[tuple, cc.P2POp]]) -> list[cc.P2POp]:
    return [op for _, op in sorted(entries, key=lambda e: e[0])]


class _Pending:
    """A posted receive: either the data itself, or first a header (shape not yet known)."""

    def __init__(self, action: Action, handle, buf: torch.Tensor, is_header: bool) -> None:
        self.action, self.handle, self.buf, self.is_header = action, handle, buf, is_header


class StageLinks:
    """The transfers of one rank: posts receives, issues sends, learns shapes once."""

    def __init__(self, group: ProcessGroup | None, schedule: Schedule, device: torch.device) -> None:
        self.group, self.schedule, self.device = group, schedule, device
        self._in_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}  # chunk -> its input's shape, dtype
        self._out_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}  # chunk -> its output's shape, dtype
        self._told: set[int] = set()  # chunks whose output header was sent under this signature
        self._signature: object = None
        self._sends: dict[Action, list] = {}  # send -> its handles (header, data), until waited

    def set_signature(self, signature: object) -> bool:
        """Start a step; forget the shapes when ``signature`` changed. Returns whether they are known."""
        if signature != self._signature:
            self._in_meta.clear()
            self._out_meta.clear()
            self._told.clear()
            self._signature = signature
            return False
        return True

    def note_output(self, chunk: int, out: torch.Tensor) -> None:
        """Remember the shape of ``chunk``'s output (the shape of the gradient it will receive)."""
        self._out_meta[chunk] = (out.shape, out.dtype)

    def known(self, a: Action) -> bool:
        """Whether the receive ``a`` can be posted without a header."""
        return a.chunk in (self._in_meta if a.kind == ActionKind.RECV_F else self._out_meta)

    def _peer(self, a: Action) -> int:
        return _peer_of(self.schedule, a)

    def _recv(self, buf: torch.Tensor, peer: int, tag: str):
        return cc.batch_p2p([cc.P2POp("recv", buf, peer, self.group)], async_op=True, tag=tag)

    def post_recv(self, a: Action) -> _Pending:
        """Post the receive of ``a`` now (a header first when the shape is not known yet)."""
        peer = self._peer(a)
        if not self.known(a):
            if a.kind != ActionKind.RECV_F:
                raise RuntimeError(f"{a}: gradient shape unknown before the forward of chunk {a.chunk}")
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
            return _Pending(a, self._recv(header, peer, HEADER_TAG), header, True)
        buf = self._buffer(a)
        return _Pending(a, self._recv(buf, peer, P2P_TAG), buf, False)

    def _buffer(self, a: Action) -> torch.Tensor:
        shape, dtype = (self._in_meta if a.kind == ActionKind.RECV_F else self._out_meta)[a.chunk]
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _learn(self, a: Action, header: torch.Tensor) -> None:
        code, ndim, *dims = header.tolist()
        self._in_meta[a.chunk] = (torch.Size(dims[:ndim]), _DTYPES[code])

    def _header(self, a: Action, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in _DTYPES or tensor.dim() > _HEADER_LEN - 2:
            raise TypeError(
                f"chunk {a.chunk} output must be a tensor of <= 8 dims and dtype in {_DTYPES}, "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        dims = list(tensor.shape) + [0] * (_HEADER_LEN - 2 - tensor.dim())
        return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *dims], dtype=torch.int64, device=self.device)

    def wait(self, pending: _Pending) -> torch.Tensor:
        """Block until the received tensor of ``pending`` is there; return it."""
        pending.handle.wait()
        if pending.is_header:
            self._learn(pending.action, pending.buf)
            return self.wait(self.post_recv(pending.action))
        return pending.buf

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Issue the send of ``a`` (asynchronous; completed by :meth:`release` or :meth:`wait_sends`)."""
        peer, tensor = self._peer(a), tensor.contiguous()
        handles = self._sends.setdefault(a, [])
        if a.kind == ActionKind.SEND_F and a.chunk not in self._told:
            header = self._header(a, tensor)
            handles.append(cc.batch_p2p([cc.P2POp("send", header, peer, self.group)], async_op=True, tag=HEADER_TAG))
            self._told.add(a.chunk)
        handles.append(cc.batch_p2p([cc.P2POp("send", tensor, peer, self.group)], async_op=True, tag=P2P_TAG))

    def release(self, sends: Iterable[Action]) -> None:
        """Complete the sends ``sends``, which the peer is known to have received (from
        :func:`send_release_points`, so this does not block on the peer), freeing their tensors."""
        for a in sends:
            for h in self._sends.pop(a, ()):
                h.wait()

    @property
    def in_flight(self) -> int:
        """Sends issued and not completed yet (their tensors are held)."""
        return len(self._sends)

    def exchange(self, sends: list[tuple[Action, torch.Tensor]], recvs: list[Action]) -> dict[Action, torch.Tensor]:
        """Grouped mode: the ``(send, tensor)`` pairs and the receives ``recvs`` as one ``batch_p2p``
        in :func:`wire_key` order, waited for (``[Note: p2p order on NCCL]``); returns the
        received tensors. Headers go with the data of a first send, and ahead of a receive
        whose shape is not known yet (its data then comes in a second group)."""
        entries: list[tuple[tuple, cc.P2POp]] = []
        for a, out in sends:
            peer, tensor = self._peer(a), out.contiguous()
            if a.kind == ActionKind.SEND_F and a.chunk not in self._told:
                entries.append((wire_key(a, header=True), cc.P2POp("send", self._header(a, tensor), peer, self.group)))
                self._told.add(a.chunk)
            entries.append((wire_key(a), cc.P2POp("send", tensor, peer, self.group)))
        bufs, headers = {}, {}
        for a in recvs:
            if self.known(a):
                bufs[a] = self._buffer(a)
                entries.append((wire_key(a), cc.P2POp("recv", bufs[a], self._peer(a), self.group)))
            else:
                headers[a] = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
                entries.append((wire_key(a, header=True), cc.P2POp("recv", headers[a], self._peer(a), self.group)))
        if entries:
            cc.batch_p2p(_sorted_ops(entries), tag=P2P_TAG)
        if headers:
            for a, h in headers.items():
                self._learn(a, h)
                bufs[a] = self._buffer(a)
            late = [(wire_key(a), cc.P2POp("recv", bufs[a], self._peer(a), self.group)) for a in headers]
            cc.batch_p2p(_sorted_ops(late), tag=P2P_TAG)
        return bufs

    def wait_sends(self) -> None:
        """Complete every send not completed yet."""
        self.release(list(self._sends))
