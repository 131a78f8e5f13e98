"""Exact recording on a manual clock: spans, collectives, bandwidths, derived figures."""

from profiler_helpers import scripted_step


def test_spans_exact():
    prof, *_ = scripted_step()
    (rec,) = prof.steps
    assert (rec.start, rec.end) == (100.0, 108.0)
    phases = {s.name: (s.start, s.end) for s in rec.spans if s.track == "phases"}
    assert phases == {"forward": (100.0, 102.0), "backward": (103.5, 105.5), "optimizer": (106.0, 107.0)}
    modules = {s.name: (s.start, s.end) for s in rec.spans if s.track == "modules"}
    # depth 2: "1.1.inner" (depth 3) is not hooked
    assert modules == {
        "0": (100.0, 101.0), "0.inner": (101.0, 101.0), "1": (101.0, 102.0), "1.0": (101.0, 101.0),
        "1.1": (101.0, 102.0), "2": (102.0, 102.0),
    }  # fmt: skip


def test_module_depth_limit():
    prof, *_ = scripted_step(module_depth=1)
    assert sorted(s.name for s in prof.steps[0].spans if s.track == "modules") == ["0", "1", "2"]


def test_collectives_exact():
    prof, *_ = scripted_step()
    ar, rs = prof.steps[0].comm
    assert (ar.op, ar.group_size, ar.nbytes, ar.dtype, ar.async_op, ar.tag) == (
        "all_reduce",
        4,
        4000,
        "float32",
        False,
        "all_reduce-tag",
    )
    assert (rs.op, rs.group_size, rs.nbytes, rs.async_op) == ("reduce_scatter", 2, 8000, True)
    assert (ar.duration, rs.duration) == (1.0, 2.5)
    # nccl-tests: algbw = bytes / time; busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (reduce_scatter)
    assert ar.algbw == 4000.0 and ar.busbw == 4000.0 * 2 * 3 / 4
    assert rs.algbw == 8000 / 2.5 and rs.busbw == 8000 / 2.5 * 1 / 2
    assert "profiler_helpers.py" in ar.caller


def test_step_figures_exact():
    prof, *_ = scripted_step(tokens_per_step=16)
    (f,) = prof.figures
    # compute = forward 2 + backward 2 + optimizer 1; comm = [102.5,103.5) + [104,106.5)
    assert (f.step_time, f.compute, f.comm) == (8.0, 5.0, 3.5)
    # overlap = [104,105.5) + [106,106.5); busy = [100,102) + [102.5,107)
    assert (f.overlap, f.exposed_comm, f.idle) == (2.0, 1.5, 1.5)
    assert (f.comm_calls, f.comm_bytes, f.wire_bytes) == (2, 12000, 4000 * 1.5 + 8000 * 0.5)
    assert f.tokens_per_s == 2.0


def test_summary_tables():
    prof, *_ = scripted_step()
    by_op = prof.summaries[0]["comm_by_op"]
    assert by_op["all_reduce"] == {
        "calls": 1,
        "bytes": 4000,
        "wire_bytes": 6000.0,
        "time": 1.0,
        "algbw": 4000.0,
        "busbw": 6000.0,
    }
    assert prof.summaries[0]["phases"] == {"forward": 2.0, "backward": 2.0, "optimizer": 1.0}
    assert "reduce_scatter" in prof.comm_table() and "profiler_helpers.py" in prof.site_table()
