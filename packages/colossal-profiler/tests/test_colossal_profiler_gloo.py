"""Two gloo ranks: a scripted sequence of colossal.comm collectives is recorded exactly.

``time.perf_counter`` is replaced on each rank by a manual clock that moves 0.25 s per read, so
every duration is an exact multiple of 0.25 s and the bandwidth checks are exact equalities.
"""

import time

import torch
import torch.distributed as dist
from profiler_helpers import ManualClock

from colossal.comm import all_gather, all_reduce, broadcast, recv, reduce_scatter, send
from colossal.comm.testing import run_distributed
from colossal.profiler import Profiler, load_summaries, summarize

TICK = 0.25


def _script(prof, clock):
    rank = dist.get_rank()
    all_reduce(torch.ones(10), tag="grads")  # 10 fp32 = 40 B
    all_gather(torch.ones(3))  # output: 2 x 3 fp32 = 24 B
    reduce_scatter(torch.ones(8))  # input: 8 fp32 = 32 B
    broadcast(torch.ones(5), src=0)  # 20 B
    handle = all_reduce(torch.ones(16, dtype=torch.float64), async_op=True)  # 128 B
    with prof.phase("compute"):  # overlaps the async all-reduce
        pass
    handle.wait()
    if rank == 0:
        send(torch.ones(4), dst=1)  # 16 B
    else:
        recv(torch.empty(4), src=0)


def _scripted_rank(out_dir):
    real, clock = time.perf_counter, ManualClock(start=1000.0, tick=TICK)
    time.perf_counter = clock
    try:
        with Profiler(out_dir=out_dir, memory=False) as prof:
            _script(prof, clock)
    finally:
        time.perf_counter = real
    rows = [(c.op, c.group_size, c.ranks, c.nbytes, c.dtype, c.async_op, c.duration, c.algbw, c.busbw, c.caller, c.tag)
            for c in prof.steps[0].comm]  # fmt: skip
    phase = [s for s in prof.steps[0].spans if s.name == "compute"][0]
    return rows, (phase.start, phase.end), prof.figures[0]


def _bus_factor(op, n):  # nccl-tests definitions, written out independently of colossal.comm
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def test_two_ranks_scripted_sequence(tmp_path):
    results = run_distributed(_scripted_rank, 2, str(tmp_path), timeout=90)
    expected = [("all_reduce", 40, "float32", False), ("all_gather", 24, "float32", False),
                ("reduce_scatter", 32, "float32", False), ("broadcast", 20, "float32", False),
                ("all_reduce", 128, "float64", True)]  # fmt: skip
    for rank, (rows, (p_start, p_end), fig) in enumerate(results):
        p2p = [("send" if rank == 0 else "recv", 16, "float32", False)]
        assert [(r[0], r[3], r[4], r[5]) for r in rows] == expected + p2p
        assert [r[1] for r in rows] == [2] * 6
        assert rows[-1][2] == ((0, 1) if rank == 0 else (1, 0)) and rows[0][2] == (0, 1)
        for op, n, _, nbytes, _, _, duration, algbw, busbw, caller, _ in rows:
            assert duration > 0 and (duration / TICK).is_integer()
            assert algbw == nbytes / duration
            assert busbw == nbytes * _bus_factor(op, n) / duration
            assert "test_colossal_profiler_gloo.py" in caller and "(_script)" in caller
        assert rows[0][-1] == "grads"
        # The phase [p_start, p_end) lies inside the async all-reduce: it is the overlap.
        assert p_end - p_start == TICK and fig.overlap == TICK and fig.compute == TICK
        assert fig.comm == sum(r[6] for r in rows) and fig.exposed_comm == fig.comm - TICK
        assert fig.comm_bytes == 40 + 24 + 32 + 20 + 128 + 16
    assert sorted(load_summaries(str(tmp_path))) == [0, 1]
    assert {p.name for p in tmp_path.iterdir()} >= {"trace.rank0.cycle0.json.gz", "trace.rank1.cycle0.json.gz"}
    text = summarize(str(tmp_path))
    (row,) = [line for line in text.splitlines() if line.startswith("| all_gather")]
    assert [c.strip() for c in row.strip("|").split("|")][1:3] == ["2", "48"]  # both ranks merged


def _straggler_rank():
    with Profiler(straggler=True, memory=False) as prof:
        if dist.get_rank() == 1:
            time.sleep(0.3)  # rank 1 arrives late: rank 0 waits for it
        all_reduce(torch.ones(4))
        all_reduce(torch.ones(4))
    return [c.wait for c in prof.steps[0].comm], prof.figures[0].straggler_wait


def test_straggler_wait():
    (waits0, total0), (waits1, total1) = run_distributed(_straggler_rank, 2, timeout=90)
    assert waits0[0] > 0.2 and waits1[0] == 0.0  # the late rank waits least: it is the straggler
    assert total0 == sum(waits0) and total1 == sum(waits1)
    assert min(waits0[1], waits1[1]) == 0.0


def _backward_rank():
    from colossal.comm import copy_to_group

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with Profiler(model, memory=False) as prof:
        x = torch.ones(2, 4, requires_grad=True)
        model(copy_to_group(x)).sum().backward()  # the gradient of x is all-reduced in the backward
    (rec,) = prof.steps[0].comm
    phases = {s.name: (s.start, s.end) for s in prof.steps[0].spans if s.track == "phases"}
    return rec.op, rec.nbytes, rec.caller, rec.start, rec.end, phases, prof.figures[0]


def test_collective_inside_backward():
    for op, nbytes, caller, start, end, phases, fig in run_distributed(_backward_rank, 2, timeout=90):
        assert (op, nbytes) == ("all_reduce", 2 * 4 * 4)
        assert "(_backward_rank)" in caller  # the user's backward() line, not torch's engine
        b_start, b_end = phases["backward"]
        assert b_start <= start and end <= b_end  # recorded inside the backward phase
        # the blocking all-reduce is not compute: compute = forward + backward - all-reduce
        total = sum(e - s for s, e in phases.values())
        assert abs(fig.compute - (total - (end - start))) < 1e-9 and fig.overlap == 0.0
