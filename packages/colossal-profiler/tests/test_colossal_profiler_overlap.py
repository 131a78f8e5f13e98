"""Interval arithmetic and the compute/communication/overlap/idle split on a hand-made step."""

import torch

from colossal.comm import CommEvent
from colossal.profiler import CommRecord, Span, StepRecord, intersect, measure, step_figures, subtract, union


def test_interval_ops():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert intersect([(0, 2), (3, 4)], [(1, 3.5)]) == [(1, 2), (3, 3.5)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert measure([(0, 2), (3, 4)]) == 3.0 and measure([]) == 0.0


def _comm(start, end, async_op):
    return CommRecord(
        op="all_reduce", group_size=2, ranks=(0, 1), nbytes=1000, wire_bytes=1000.0, dtype="float32",
        async_op=async_op, start=start, end=end, tag="", caller="x",
    )  # fmt: skip


def test_overlap_hand_computed():
    # Step [0, 20) s. Phases: forward [1, 5), backward [6, 14), optimizer [15, 17).
    # Collectives: a blocking one inside forward [2, 3) (host waits: not compute),
    # an async one [8, 16) overlapping backward [8, 14) and the gap [14, 15) and optimizer [15, 16).
    rec = StepRecord(step=7, start=0.0, end=20.0)
    rec.spans = [
        Span("forward", "phases", 1, 5),
        Span("backward", "phases", 6, 14),
        Span("optimizer", "phases", 15, 17),
    ]
    rec.spans.append(Span("layer", "modules", 1, 4))  # module spans do not add compute
    rec.comm = [_comm(2, 3, False), _comm(8, 16, True)]
    f = step_figures(rec, tokens=40, peak_flops=None)
    # compute = [1,2) + [3,5) + [6,14) + [15,17) = 1 + 2 + 8 + 2 = 13
    assert f.compute == 13.0
    # comm = [2,3) + [8,16) = 9 ; overlap = [8,14) + [15,16) = 7 ; exposed = 9 - 7 = 2
    assert (f.comm, f.overlap, f.exposed_comm) == (9.0, 7.0, 2.0)
    # busy = compute U comm = [1,5) + [6,17) = 15 ; idle = 20 - 15 = 5
    assert f.idle == 5.0
    assert f.step_time == 20.0 and f.tokens_per_s == 2.0 and f.comm_calls == 2 and f.comm_bytes == 2000


def test_flops_and_mfu():
    rec = StepRecord(step=0, start=0.0, end=2.0, flops=8_000)
    f = step_figures(rec, peak_flops=8_000.0)
    assert f.flops_per_s == 4_000.0 and f.mfu == 0.5


def test_comm_event_fields_match_record():
    # The recorder copies colossal.comm's event; the derived bandwidths use its wire_bytes.
    ev = CommEvent(op="all_gather", group_size=4, ranks=(0, 1, 2, 3), nbytes=4096, dtype=torch.float16,
                   async_op=False, start=1.0, end=1.5)  # fmt: skip
    assert ev.wire_bytes == 4096 * 3 / 4
