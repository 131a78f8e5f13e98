"""Pipeline schedules: each one a small class that lists the actions of every rank.

A schedule decides only the *order of compute* on each rank (forward, backward, or backward
split into input-gradient and weight-gradient passes); :meth:`Schedule.actions` inserts the
point-to-point transfers around it in one fixed way (a receive right before the compute that
consumes it, a send right after the compute that produces it), so every schedule talks the same
way and the simulator (:mod:`colossal.pipeline.simulate`) checks exactly what the executor runs.

Chunks are numbered globally: with ``p`` ranks and ``v`` virtual stages per rank there are
``p * v`` chunks and chunk ``c`` lives on rank ``c % p`` (Megatron's interleaved placement; with
``v = 1`` chunk ``c`` is rank ``c``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "GPipe",
    "OneFOneB",
    "Interleaved1F1B",
    "ZeroBubbleH1",
    "SCHEDULES",
    "get_schedule",
]


class ActionKind(enum.StrEnum):
    """What one step of a rank's program does."""

    F = "F"
    """Forward of one micro-batch through one chunk."""
    B = "B"
    """Full backward (input and weight gradients) of one micro-batch through one chunk."""
    BI = "BI"
    """Input-gradient half of the backward; weight gradients of linear layers are deferred."""
    BW = "BW"
    """Weight-gradient half: runs the deferred weight-gradient products of one (micro-batch, chunk)."""
    SEND_F = "SEND_F"
    """Send the chunk's output activation to the rank holding the next chunk."""
    RECV_F = "RECV_F"
    """Receive the chunk's input activation from the rank holding the previous chunk."""
    SEND_B = "SEND_B"
    """Send the gradient of the chunk's input to the rank holding the previous chunk."""
    RECV_B = "RECV_B"
    """Receive the gradient of the chunk's output from the rank holding the next chunk."""

    @property
    def is_comm(self) -> bool:
        """Whether the action is a transfer (not a compute)."""
        return self in (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)


class Action(NamedTuple):
    """One step of a rank's program: ``kind`` applied to micro-batch ``mb`` of global chunk ``chunk``."""

    kind: ActionKind
    mb: int
    chunk: int

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.mb}.{self.chunk}"


class Schedule:
    """Order of forward/backward compute per rank for ``n_stages`` ranks, ``n_microbatches``
    micro-batches and ``n_virtual`` chunks per rank.

    Subclasses implement :meth:`compute_order`; they state in ``min_microbatches`` (a function of
    the stage count) what they need and in ``virtual`` whether they take ``n_virtual > 1``.
    """

    name: ClassVar[str] = ""
    virtual: ClassVar[bool] = False
    """Whether the schedule supports more than one chunk per rank."""
    split_backward: ClassVar[bool] = False
    """Whether the schedule uses ``BI``/``BW`` instead of ``B``."""

    def __init__(self, n_stages: int, n_microbatches: int, n_virtual: int = 1) -> None:
        for what, val in (("n_stages", n_stages), ("n_microbatches", n_microbatches), ("n_virtual", n_virtual)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{what} must be a positive int, got {val!r}")
        if n_virtual > 1 and not self.virtual:
            raise ValueError(
                f"schedule {self.name!r} runs one chunk per rank, got n_virtual={n_virtual}; use 'interleaved'"
            )
        need = self.min_microbatches(n_stages)
        if n_microbatches < need:
            raise ValueError(
                f"schedule {self.name!r} on {n_stages} stages needs at least {need} micro-batches, "
                f"got num_microbatches={n_microbatches}"
            )
        self.p, self.m, self.v = n_stages, n_microbatches, n_virtual

    def min_microbatches(self, n_stages: int) -> int:
        """Fewest micro-batches the schedule runs with on ``n_stages`` stages."""
        return 1

    @property
    def n_chunks(self) -> int:
        """Global number of chunks, ``p * v``."""
        return self.p * self.v

    def rank_of(self, chunk: int) -> int:
        """Rank holding global chunk ``chunk``."""
        return chunk % self.p

    def compute_order(self, rank: int) -> list[Action]:
        """The ``F``/``B``/``BI``/``BW`` actions of ``rank`` in execution order."""
        raise NotImplementedError

    def actions(self, rank: int) -> Iterator[Action]:
        """The full program of ``rank``: compute with its transfers (see the module docstring).

        Transfers between two chunks on the same rank (``p = 1``) are local and not listed.
        """
        last = self.n_chunks - 1
        for a in self.compute_order(rank):
            if a.kind == ActionKind.F and a.chunk > 0 and self.rank_of(a.chunk - 1) != rank:
                yield Action(ActionKind.RECV_F, a.mb, a.chunk)
            if a.kind in (ActionKind.B, ActionKind.BI) and a.chunk < last and self.rank_of(a.chunk + 1) != rank:
                yield Action(ActionKind.RECV_B, a.mb, a.chunk)
            yield a
            if a.kind == ActionKind.F and a.chunk < last and self.rank_of(a.chunk + 1) != rank:
                yield Action(ActionKind.SEND_F, a.mb, a.chunk)
            if a.kind in (ActionKind.B, ActionKind.BI) and a.chunk > 0 and self.rank_of(a.chunk - 1) != rank:
                yield Action(ActionKind.SEND_B, a.mb, a.chunk)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p}, m={self.m}, v={self.v})"


def _one_f_one_b(rank: int, p: int, m: int, backward: list[ActionKind]) -> list[Action]:
    """PipeDream-flush order on one chunk per rank; ``backward`` is ``[B]`` or ``[BI]``."""
    warmup = min(p - rank - 1, m)
    order = [Action(ActionKind.F, i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(Action(ActionKind.F, warmup + i, rank))
        order += [Action(k, i, rank) for k in backward]
    for i in range(m - warmup, m):
        order += [Action(k, i, rank) for k in backward]
    return order


class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al., 2019): ``m`` activations in flight per stage."""

    name = "gpipe"

    def compute_order(self, rank: int) -> list[Action]:
        """Forward every micro-batch, then backward every micro-batch, in order."""
        fwd = [Action(ActionKind.F, i, rank) for i in range(self.m)]
        return fwd + [Action(ActionKind.B, i, rank) for i in range(self.m)]


class OneFOneB(Schedule):
    """PipeDream-flush 1F1B (Narayanan et al., 2019): ``p - rank - 1`` warm-up forwards, then one
    forward and one backward alternately; at most ``p - rank`` activations in flight."""

    name = "1f1b"

    def compute_order(self, rank: int) -> list[Action]:
        """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
        return _one_f_one_b(rank, self.p, self.m, [ActionKind.B])


class Interleaved1F1B(Schedule):
    """Interleaved 1F1B with ``v`` chunks per rank (Narayanan et al., SC'21, the Megatron-LM order).

    Micro-batches go in groups of ``p``: a rank runs group ``g``'s forwards through chunk 0, then
    chunk 1, ...; backwards visit the chunks in reverse. Rank ``r`` warms up with
    ``2 (p - r - 1) + (v - 1) p`` forwards. The bubble shrinks by ``v``; the activations in flight
    grow to ``min(m v, 2 (p - r - 1) + (v - 1) p + 1)`` chunk-sized ones.
    """

    name = "interleaved"
    virtual = True

    def __init__(self, n_stages: int, n_microbatches: int, n_virtual: int = 1) -> None:
        super().__init__(n_stages, n_microbatches, n_virtual)
        if n_microbatches % n_stages:
            raise ValueError(
                f"schedule 'interleaved' needs num_microbatches divisible by the {n_stages} stages, "
                f"got num_microbatches={n_microbatches}"
            )

    def min_microbatches(self, n_stages: int) -> int:
        """The micro-batches go round the ranks in groups of ``p``: at least one group."""
        return n_stages

    def _virtual(self, k: int, forward: bool, rank: int) -> tuple[int, int]:
        """(micro-batch, global chunk) of the ``k``-th forward or backward of ``rank``."""
        p, v = self.p, self.v
        local = (k % (p * v)) // p
        if not forward:
            local = v - 1 - local
        return (k // (p * v)) * p + k % p, local * p + rank

    def warmup(self, rank: int) -> int:
        """Forwards of ``rank`` before its first backward."""
        return min((self.p - rank - 1) * 2 + (self.v - 1) * self.p, self.m * self.v)

    def compute_order(self, rank: int) -> list[Action]:
        """Megatron's interleaved order: warm-up, steady F/B pairs, cool-down."""
        total, warmup = self.m * self.v, self.warmup(rank)
        fwd = [Action(ActionKind.F, *self._virtual(k, True, rank)) for k in range(total)]
        bwd = [Action(ActionKind.B, *self._virtual(k, False, rank)) for k in range(total)]
        order = fwd[:warmup]
        for k in range(total - warmup):
            order += [fwd[warmup + k], bwd[k]]
        return order + bwd[total - warmup :]


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

    1F1B's order with the backward split in two: the input-gradient pass ``BI`` stays on the
    critical path between stages; the weight-gradient pass ``BW`` of rank ``r`` trails its ``BI``
    by ``r`` micro-batches in the steady phase (the later stages wait less for gradients, so they
    carry the work), and in the cool-down every ``BI`` is followed by one ``BW``, filling the gaps
    where 1F1B waits. Activations in flight stay 1F1B's (``p - r``); with ``T_F = T_BI = T_BW``
    the bubble is ``(p - 1) T_F``, a third of 1F1B's ``(p - 1)(T_F + T_B)``.
    """

    name = "zero_bubble"
    split_backward = True

    def compute_order(self, rank: int) -> list[Action]:
        """Warm-up forwards, steady ``F BI`` with ``BW`` lagging by ``rank``, cool-down ``BI BW``."""
        p, m, K = self.p, self.m, ActionKind
        warmup = min(p - rank - 1, m)
        order = [Action(K.F, i, rank) for i in range(warmup)]
        pending: list[Action] = []
        for i in range(m):
            if i < m - warmup:
                order.append(Action(K.F, warmup + i, rank))
            order.append(Action(K.BI, i, rank))
            pending.append(Action(K.BW, i, rank))
            if i >= m - warmup or len(pending) > rank:
                order.append(pending.pop(0))
        return order + pending


SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1)}
"""Schedules by name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``."""


def get_schedule(name: str | Schedule, n_stages: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """The schedule called ``name`` (or ``name`` itself when it already is a :class:`Schedule`)."""
    if isinstance(name, Schedule):
        return name
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name](n_stages, n_microbatches, n_virtual)
