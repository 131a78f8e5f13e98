"""Schedules, run by the pure-Python simulator over a grid of (p, m, v): no deadlock, every
transfer matches, and the measured peak activations and bubble equal the papers' formulas."""

import itertools

import pytest

from colossal.pipeline import (
    ActionKind,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleError,
    ZeroBubbleH1,
    get_schedule,
    simulate,
)
from colossal.pipeline.p2p import exchange_groups, send_release_points, split_steps
from colossal.pipeline.schedules import Action, Schedule
from colossal.pipeline.simulate import _check_pair_order, grouping_for, simulate_groups

PS, MS, VS = (1, 2, 3, 4, 8), (1, 2, 3, 4, 6, 8, 16), (1, 2, 3)


def _grid(cls):
    for p, m, v in itertools.product(PS, MS, VS):
        if v > 1 and not cls.virtual:
            continue
        try:
            yield p, m, v, cls(p, m, v)
        except ValueError:
            assert cls is Interleaved1F1B and (m < p or m % p), (p, m, v)


def test_gpipe_grid():
    for p, m, _, s in _grid(GPipe):
        r = simulate(s)
        assert r.peak_inflight == (m,) * p  # every micro-batch held until the backward starts
        assert r.makespan == 3 * (m + p - 1)  # F=1, B=2
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_grid():
    for p, m, _, s in _grid(OneFOneB):
        r = simulate(s)
        assert r.peak_inflight == tuple(min(m, p - i) for i in range(p))
        assert r.makespan == 3 * (m + p - 1)
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_interleaved_grid():
    for p, m, v, s in _grid(Interleaved1F1B):
        r = simulate(s)
        # Narayanan et al. 2021: warm-up 2(p - r - 1) + (v - 1)p forwards, then one more before
        # the first backward; chunk-sized activations
        assert r.peak_inflight == tuple(min(m * v, 2 * (p - i - 1) + (v - 1) * p + 1) for i in range(p))
        # the bubble shrinks by v: (p - 1)/v of a whole-stage F+B, against m of them
        assert r.bubble == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))


def test_zero_bubble_grid():
    for p, m, _, s in _grid(ZeroBubbleH1):
        r, one = simulate(s), simulate(OneFOneB(p, m))
        assert r.peak_inflight == one.peak_inflight  # H1: 1F1B's activation memory
        assert r.makespan <= one.makespan
        if m >= p:  # T_F = T_BI = T_BW: bubble (p - 1) T_F, a third of 1F1B's 3 (p - 1)
            assert r.makespan == 3 * m + (p - 1)
            assert r.bubble == pytest.approx((p - 1) / (3 * m + p - 1))


def test_every_action_once_on_its_rank():
    s = Interleaved1F1B(4, 8, 2)
    computes = [a for r in range(4) for a in s.compute_order(r)]
    assert len(computes) == len(set(computes)) == 2 * 8 * 8
    assert all(s.rank_of(a.chunk) == r for r in range(4) for a in s.compute_order(r))


def test_simulator_catches_deadlock_and_mismatch():
    class Swapped(OneFOneB):  # the first stage runs its first two backwards out of order
        def compute_order(self, rank):
            order = super().compute_order(rank)
            if rank == 0:
                b = [i for i, a in enumerate(order) if a.kind == ActionKind.B]
                order[b[0]], order[b[1]] = order[b[1]], order[b[0]]
            return order

    with pytest.raises(ScheduleError, match="expecting"):
        simulate(Swapped(2, 4))

    class Starved(Schedule):  # rank 0 waits for a gradient before it ever sends a forward
        name = "starved"

        def compute_order(self, rank):
            if rank == 0:
                return [Action(ActionKind.B, 0, 0), Action(ActionKind.F, 0, 0)]
            return [Action(ActionKind.F, 0, 1), Action(ActionKind.B, 0, 1)]

    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Starved(2, 1))


@pytest.mark.parametrize(
    "args, match",
    [
        (("interleaved", 4, 2, 2), "at least 4 micro-batches"),
        (("interleaved", 4, 6, 2), "divisible by the 4 stages"),
        (("1f1b", 4, 8, 2), "one chunk per rank"),
        (("pipedream", 2, 2, 1), "pp_schedule must be one of"),
        (("gpipe", 2, 0, 1), "n_microbatches must be a positive int"),
    ],
)
def test_bad_schedule_config(args, match):
    with pytest.raises(ValueError, match=match):
        get_schedule(*args)


@pytest.mark.parametrize("cls", [GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1], ids=lambda c: c.name)
def test_grouped_p2p_order_is_what_nccl_needs(cls):
    """[Note: p2p order on NCCL]: for every (p, m, v), the chosen grouping has, between every two
    ranks, the sends of one in the order of the other's receives (message by message, headers
    first), and its groups, run with NCCL's blocking semantics, finish on every rank."""
    paired_needed = []
    for p, m, v, s in _grid(cls):
        paired = grouping_for(s)
        for headers in (False, True):
            simulate_groups(s, headers, paired)  # raises ScheduleError on a mismatch or a deadlock
        if paired:
            paired_needed.append((p, m, v))
    assert not paired_needed or cls is Interleaved1F1B, paired_needed


def test_grouped_p2p_check_catches_a_deadlock_and_a_mismatch():
    """The checker is not vacuous: unpaired interleaved on 2 ranks deadlocks under NCCL's
    semantics, and a receive order that differs from the send order is reported."""
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate_groups(Interleaved1F1B(2, 4, 2), paired=False)
    s = OneFOneB(2, 2)
    groups = [exchange_groups(s, r) for r in range(2)]
    _check_pair_order(s, groups)
    recvs = [w for g in groups[1] for w in g if not w.send]
    assert len(recvs) == 2  # rank 1 receives two activations; receive them in the other order
    groups[1] = [[w if w.send else recvs[1 - recvs.index(w)] for w in g] for g in groups[1]]
    with pytest.raises(ScheduleError, match="which receives"):
        _check_pair_order(s, groups)


def _message(a: Action) -> tuple[bool, int, int]:
    """(backward, micro-batch, sending chunk) of a send or a receive."""
    K = ActionKind
    sender = {K.SEND_F: a.chunk, K.SEND_B: a.chunk, K.RECV_F: a.chunk - 1, K.RECV_B: a.chunk + 1}[a.kind]
    return a.kind in (K.SEND_B, K.RECV_B), a.mb, sender


def _vector_clocks(s: Schedule) -> dict[int, list[list[int]]]:
    """Per rank and step, how many steps of every rank have had their receives waited before
    this step's receives are (happens-before over the overlap mode: a rank waits its receives,
    computes, then sends; a receive completes after its send). Vector clocks, Lamport-style."""
    progs = {r: split_steps(s.actions(r)) for r in range(s.p)}
    clocks: dict[int, list[list[int]]] = {r: [] for r in progs}
    sent: dict[tuple, list[int]] = {}  # message -> clock of the step that sent it
    while any(len(clocks[r]) < len(progs[r]) for r in progs):
        moved = False
        for r, prog in progs.items():
            i = len(clocks[r])
            if i == len(prog) or any(_message(a) not in sent for a in prog[i][0]):
                continue
            c = list(clocks[r][-1]) if i else [0] * s.p
            for a in prog[i][0]:
                c = [max(x, y) for x, y in zip(c, sent[_message(a)], strict=True)]
            c[r] = i + 1
            clocks[r].append(c)
            sent.update((_message(a), c) for a in prog[i][2])
            moved = True
        assert moved, s  # the overlap mode never deadlocks
    return clocks


@pytest.mark.parametrize("cls", [GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1], ids=lambda c: c.name)
def test_send_release_points_never_wait_on_the_peer(cls):
    """[Note: releasing sends on gloo]: every send is released at most once, at a step after the
    one issuing it, and only where the peer's wait for it happens-before (vector clocks, computed
    here independently) this rank's receives of that step; an activation is released no later
    than its own backward; on 1F1B at most ``p - r`` activations and one gradient stay held."""
    for p, m, _v, s in _grid(cls):
        clocks, progs = _vector_clocks(s), {r: split_steps(s.actions(r)) for r in range(p)}
        for r, prog in progs.items():
            issued = {a: i for i, (_, _, sends) in enumerate(prog) for a in sends}
            recv_step = {q: {_message(a): i for i, (recvs, _, _) in enumerate(progs[q]) for a in recvs} for q in progs}
            backward_at = {(c.mb, c.chunk): i for i, (_, c, _) in enumerate(prog) if c.kind != ActionKind.F}
            released, held, peak, plan = set(), set(), 0, send_release_points(s, r)
            for j, sends in enumerate(plan):
                for a in sends:
                    assert a not in released and issued[a] < j, (s, r, a, j)
                    q = s.rank_of(a.chunk + (1 if a.kind == ActionKind.SEND_F else -1))
                    assert clocks[r][j][q] > recv_step[q][_message(a)], (s, r, a, j)  # peer has it
                    released.add(a)
                held = (held - set(sends)) | set(prog[j][2])
                peak = max(peak, len(held))
            for a in issued:
                if a.kind == ActionKind.SEND_F and a.chunk + 1 < s.n_chunks:
                    assert a in released, (s, r, a)
                    j = next(k for k, x in enumerate(plan) if a in x)
                    assert j <= backward_at[(a.mb, a.chunk)], (s, r, a)
            if cls is OneFOneB:
                assert peak <= min(m, p - r) + 1, (s, r, peak)
