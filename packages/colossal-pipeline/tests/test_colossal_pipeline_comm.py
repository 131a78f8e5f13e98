"""Communication per step, observed as CommEvents, equals the formula.

Per rank and step: every chunk ``c`` it holds sends ``m`` activations forward (``c < pv - 1``)
and ``m`` input gradients backward (``c > 0``), each ``(B/m) T H`` fp32 elements; the first step
of a new input shape also sends one 80-byte shape header per forward boundary; the two holders of
a tied embedding exchange its gradient (``V H`` fp32) once; the loss is one fp32 broadcast.
"""

import torch
from pp_testing import BATCH, H, T, V, batch, check_pipeline, lm_loss

from colossal.comm import CommCounter
from colossal.comm.testing import run_distributed
from colossal.pipeline import HEADER_TAG, LOSS_TAG, P2P_TAG, TIED_TAG, PipelineConfig

F32 = 4


def _rank(cases):
    p, r = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for sched, v, m in cases:
        pipe = check_pipeline(PipelineConfig(num_microbatches=m, schedule=sched, virtual=v), tied=True, seeds=())
        n_chunks = p * v
        mine = [r + k * p for k in range(v)]
        act = BATCH // m * T * H * F32
        fwd_edges = sum(c < n_chunks - 1 for c in mine)
        expect = (fwd_edges + sum(c > 0 for c in mine)) * m * act
        tied = V * H * F32 if r in (0, p - 1) else 0
        for step in range(2):
            idx, tgt = batch(step)
            with CommCounter() as counter:
                pipe.step(idx, tgt, lm_loss)
            got = dict(counter.by_tag)
            assert got.get(P2P_TAG, 0) == expect, (sched, step, got, expect)
            assert got.get(HEADER_TAG, 0) == (80 * fwd_edges if step == 0 else 0), (sched, step, got)
            assert got.get(TIED_TAG, 0) == tied, (sched, got)
            assert got.get(LOSS_TAG, 0) == F32, (sched, got)
            assert set(got) <= {P2P_TAG, HEADER_TAG, TIED_TAG, LOSS_TAG}, got


def test_comm_bytes_equal_formula():
    run_distributed(_rank, 4, [("1f1b", 1, 4), ("interleaved", 2, 4), ("zero_bubble", 1, 8)], timeout=180)
