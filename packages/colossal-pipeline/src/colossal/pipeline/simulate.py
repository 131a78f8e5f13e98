"""Run every rank's program of a schedule in pure Python: deadlocks, order, memory, bubble.

The model is the executor's (:mod:`colossal.pipeline.runtime`): a send never blocks; a receive
blocks until the peer has issued the matching send; messages on one (sender, receiver) channel
match in order, so the ``k``-th receive must expect exactly the ``k``-th send. Compute takes a
fixed time per kind and transfers take none, which gives the schedule's ideal timeline and
bubble. Tests run this over a grid of ``(p, m, v)``; it costs microseconds per action.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from colossal.pipeline.p2p import Wire, exchange_groups
from colossal.pipeline.schedules import Action, ActionKind, Schedule

__all__ = ["SimResult", "ScheduleError", "grouping_for", "simulate", "simulate_groups"]

_K = ActionKind
DEFAULT_TIMES = {_K.F: 1.0, _K.B: 2.0, _K.BI: 1.0, _K.BW: 1.0}
"""Forward 1, backward 2 (input and weight gradient 1 each): the usual transformer ratio."""


class ScheduleError(RuntimeError):
    """The schedule deadlocks, mismatches a transfer, or breaks a data dependency."""


@dataclasses.dataclass(frozen=True, slots=True)
class SimResult:
    """What a simulated step showed."""

    makespan: float
    """Time from the first action to the last one finishing, in units of a forward."""
    busy: tuple[float, ...]
    """Compute time per rank."""
    peak_inflight: tuple[int, ...]
    """Per rank, the most (micro-batch, chunk) activations held at once (forward done, backward
    or input-gradient pass not yet done)."""
    peak_pending_weight: tuple[int, ...]
    """Per rank, the most deferred weight-gradient passes waiting at once (split backward only)."""

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks: ``1 - sum(busy) / (p * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _matching_send(a: Action) -> Action:
    """The send a receive expects."""
    if a.kind == _K.RECV_F:
        return Action(_K.SEND_F, a.mb, a.chunk - 1)
    return Action(_K.SEND_B, a.mb, a.chunk + 1)


class _Rank:
    def __init__(self, rank: int, program: list[Action]) -> None:
        self.rank, self.program, self.pc, self.clock = rank, program, 0, 0.0
        self.busy, self.inflight, self.peak, self.pending_w, self.peak_w = 0.0, 0, 0, 0, 0
        self.recv_count: dict[int, int] = defaultdict(int)


def simulate(schedule: Schedule, times: dict[ActionKind, float] | None = None) -> SimResult:
    """Run ``schedule`` on its ``p`` ranks; raise :class:`ScheduleError` on a deadlock, a receive
    that does not match its send, or a compute whose input is not ready."""
    times = {**DEFAULT_TIMES, **(times or {})}
    ranks = [_Rank(r, list(schedule.actions(r))) for r in range(schedule.p)]
    sent: dict[tuple[int, int], list[tuple[Action, float]]] = defaultdict(list)  # (src, dst) -> sends
    done: dict[tuple[ActionKind, int, int], float] = {}  # (kind, mb, chunk) -> finish time
    while any(r.pc < len(r.program) for r in ranks):
        progressed = False
        for r in ranks:
            while r.pc < len(r.program) and _step(schedule, r, sent, done, times):
                r.pc += 1
                progressed = True
        if not progressed:
            stuck = {r.rank: r.program[r.pc] for r in ranks if r.pc < len(r.program)}
            raise ScheduleError(f"{schedule!r} deadlocks; ranks blocked at {stuck}")
    _check_complete(schedule, done)
    return SimResult(
        makespan=max(r.clock for r in ranks),
        busy=tuple(r.busy for r in ranks),
        peak_inflight=tuple(r.peak for r in ranks),
        peak_pending_weight=tuple(r.peak_w for r in ranks),
    )


def _step(schedule: Schedule, r: _Rank, sent, done, times) -> bool:
    """Execute ``r``'s next action if it can run now; return whether it ran."""
    a = r.program[r.pc]
    if a.kind in (_K.SEND_F, _K.SEND_B):
        peer = schedule.rank_of(a.chunk + (1 if a.kind == _K.SEND_F else -1))
        sent[(r.rank, peer)].append((a, r.clock))
        return True
    if a.kind in (_K.RECV_F, _K.RECV_B):
        want = _matching_send(a)
        peer = schedule.rank_of(want.chunk)
        channel, k = sent[(peer, r.rank)], r.recv_count[peer]
        if k >= len(channel):
            return False  # the peer has not sent yet: blocked
        got, at = channel[k]
        if got != want:
            raise ScheduleError(f"{schedule!r}: rank {r.rank} receives {a} expecting {want} but {peer} sent {got}")
        r.recv_count[peer] += 1
        r.clock = max(r.clock, at)
        return True
    start = max([r.clock] + [done[d] for d in _deps(schedule, a, done, r.rank)])
    r.clock = start + times[a.kind]
    r.busy += times[a.kind]
    done[(a.kind, a.mb, a.chunk)] = r.clock
    _account(r, a)
    return True


def _deps(schedule: Schedule, a: Action, done, rank: int) -> list[tuple[ActionKind, int, int]]:
    """The computes ``a`` needs; raise if one has not run (transfers already waited for them)."""
    last = schedule.n_chunks - 1
    if a.kind == _K.F:
        need = [(_K.F, a.mb, a.chunk - 1)] if a.chunk > 0 else []
    elif a.kind in (_K.B, _K.BI):
        nxt = [(_K.B, a.mb, a.chunk + 1), (_K.BI, a.mb, a.chunk + 1)] if a.chunk < last else []
        need = [(_K.F, a.mb, a.chunk)] + ([next(k for k in nxt if k in done)] if any(k in done for k in nxt) else nxt)
    else:
        need = [(_K.BI, a.mb, a.chunk)]
    missing = [d for d in need if d not in done]
    if missing or (a.kind, a.mb, a.chunk) in done or schedule.rank_of(a.chunk) != rank:
        raise ScheduleError(f"{schedule!r}: rank {rank} runs {a} before {missing} (or twice, or off its rank)")
    return need


def _account(r: _Rank, a: Action) -> None:
    if a.kind == _K.F:
        r.inflight += 1
        r.peak = max(r.peak, r.inflight)
    elif a.kind in (_K.B, _K.BI):
        r.inflight -= 1
        if a.kind == _K.BI:
            r.pending_w += 1
            r.peak_w = max(r.peak_w, r.pending_w)
    elif a.kind == _K.BW:
        r.pending_w -= 1


def _check_complete(schedule: Schedule, done) -> None:
    for mb in range(schedule.m):
        for c in range(schedule.n_chunks):
            backward = (_K.BI, _K.BW) if schedule.split_backward else (_K.B,)
            missing = [k for k in (_K.F, *backward) if (k, mb, c) not in done]
            if missing:
                raise ScheduleError(f"{schedule!r} never runs {missing} of micro-batch {mb} chunk {c}")


def grouping_for(schedule: Schedule) -> bool:
    """Whether grouped mode pairs forward and backward into one block (``paired`` of
    :func:`~colossal.pipeline.p2p.exchange_blocks`): the first of unpaired, paired whose groups,
    with and without headers, pass :func:`simulate_groups`. Raises ``ValueError`` when neither
    does (none in the tested grid), so a configuration that could hang on NCCL fails at setup."""
    errors = []
    for paired in (False, True):
        try:
            for headers in (True, False):
                simulate_groups(schedule, headers, paired)
            return paired
        except ScheduleError as e:
            errors.append(str(e))
    raise ValueError(f"{schedule!r} has no deadlock-free grouped p2p order for NCCL: {errors}")


def simulate_groups(schedule: Schedule, headers: bool = False, paired: bool = False) -> int:
    """Run the grouped-mode transfers of every rank (:func:`~colossal.pipeline.p2p.exchange_groups`)
    with NCCL's semantics (``[Note: p2p order on NCCL]``): a rank's groups run one after the
    other (a stream), an operation completes once the peer has reached the group holding its
    match, a group finishes when all its operations have, and the ``k``-th send from ``a`` to
    ``b`` matches the ``k``-th receive of ``b`` from ``a``, which must be the same message.
    Raises :class:`ScheduleError` on a mismatch or a deadlock; returns the number of rounds
    (groups finishing together)."""
    groups = [exchange_groups(schedule, r, headers, paired) for r in range(schedule.p)]
    _check_pair_order(schedule, groups)
    # position of each operation: (rank, peer, send, index on that directed channel) -> group index
    where: dict[tuple[int, int, bool, int], int] = {}
    for r, gs in enumerate(groups):
        count: dict[tuple[int, bool], int] = defaultdict(int)
        for gi, g in enumerate(gs):
            for w in g:
                where[(r, w.peer, w.send, count[(w.peer, w.send)])] = gi
                count[(w.peer, w.send)] += 1
    at, rounds = [0] * schedule.p, 0
    ops = [_indexed(gs) for gs in groups]
    while any(at[r] < len(groups[r]) for r in range(schedule.p)):
        ready = [r for r in range(schedule.p) if at[r] < len(groups[r]) and _can_finish(r, at, ops, where)]
        if not ready:
            stuck = {r: groups[r][at[r]] for r in range(schedule.p) if at[r] < len(groups[r])}
            raise ScheduleError(f"{schedule!r} grouped p2p deadlocks; ranks blocked at {stuck}")
        for r in ready:
            at[r] += 1
        rounds += 1
    return rounds


def _indexed(gs: list[list[Wire]]) -> list[list[tuple[Wire, int]]]:
    """Each operation with its index on its directed channel."""
    count: dict[tuple[int, bool], int] = defaultdict(int)
    out = []
    for g in gs:
        row = []
        for w in g:
            row.append((w, count[(w.peer, w.send)]))
            count[(w.peer, w.send)] += 1
        out.append(row)
    return out


def _can_finish(r: int, at: list[int], ops, where) -> bool:
    """Whether every operation of ``r``'s current group meets its match: the peer is at (or
    already past) the group holding it, so both operations have been launched."""
    for w, k in ops[r][at[r]]:
        there = where.get((w.peer, r, not w.send, k))
        if there is None or there > at[w.peer]:
            return False
    return True


def _check_pair_order(schedule: Schedule, groups: list[list[list[Wire]]]) -> None:
    """The sends from ``a`` to ``b`` and the receives of ``b`` from ``a`` list the same messages in
    the same order."""
    seq: dict[tuple[int, int, bool], list[tuple]] = defaultdict(list)
    for r, gs in enumerate(groups):
        for g in gs:
            for w in g:
                seq[(r, w.peer, w.send)].append(w.key)
    for (r, peer, send), keys in seq.items():
        if send and seq.get((peer, r, False), []) != keys:
            raise ScheduleError(
                f"{schedule!r}: rank {r} sends {keys} to {peer}, which receives {seq.get((peer, r, False), [])}"
            )
        if not send and (peer, r, True) not in seq:
            raise ScheduleError(f"{schedule!r}: rank {r} receives {keys} from {peer}, which sends nothing")
