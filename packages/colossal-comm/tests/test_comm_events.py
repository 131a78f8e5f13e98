"""Comm events: exact counts, bytes and bus factors for a scripted sequence."""

import pytest
import torch
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import run_distributed


def test_bus_factors_follow_nccl_tests():
    assert cc.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert cc.bus_factor("all_gather", 4) == cc.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert cc.bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert cc.bus_factor("broadcast", 4) == 1.0 and cc.bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown communication op 'gossip'"):
        cc.bus_factor("gossip", 2)


def test_observer_registry_is_empty_by_default_and_removable():
    assert not cc.has_observers()
    seen = []
    with cc.register_observer(seen.append):
        assert cc.has_observers()
    assert not cc.has_observers()
    with pytest.raises(TypeError, match="observer must be callable"):
        cc.register_observer(42)


def scripted() -> dict:
    n = dist.get_world_size()
    with cc.CommCounter() as counter:
        cc.all_reduce(torch.ones(10))  # 40 B
        cc.all_gather(torch.ones(3, dtype=torch.float64), tag="g")  # out n*24 B
        cc.reduce_scatter(torch.ones(4 * n, dtype=torch.bfloat16))  # in 8n B
        h = cc.all_to_all(torch.ones(2 * n, dtype=torch.int32), async_op=True)  # 8n B
        h.wait()
        h.wait()  # idempotent: reported once
        cc.broadcast(torch.ones(5), src=0)  # 20 B
        cc.ring_exchange(torch.ones(6))  # 24 B
    ev = counter.events
    return {
        "ops": [e.op for e in ev],
        "nbytes": dict(counter.nbytes),
        "wire": dict(counter.wire_bytes),
        "async": [e.async_op for e in ev],
        "tags": dict(counter.by_tag),
        "ranks": ev[0].ranks,
        "numel": ev[1].numel,
        "ordered": all(e.end >= e.start for e in ev),
        "after": cc.has_observers(),
    }


def test_scripted_sequence_is_recorded_exactly():
    n = 4
    out = run_distributed(scripted, n)
    assert all(o == out[0] for o in out)
    o = out[0]
    assert o["ops"] == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ring_exchange"]
    assert o["nbytes"] == {
        "all_reduce": 40,
        "all_gather": n * 24,
        "reduce_scatter": 8 * n,
        "all_to_all": 8 * n,
        "broadcast": 20,
        "ring_exchange": 24,
    }
    assert o["wire"]["all_reduce"] == pytest.approx(40 * 2 * (n - 1) / n)
    assert o["wire"]["all_gather"] == pytest.approx(n * 24 * (n - 1) / n)
    assert o["async"] == [False, False, False, True, False, False]
    assert o["tags"]["g"] == n * 24 and o["ranks"] == (0, 1, 2, 3) and o["numel"] == 3 * n
    assert o["ordered"] and o["after"] is False


def test_observer_registries_are_independent():
    a, b, seen = cc.ObserverRegistry(), cc.ObserverRegistry(), []
    handle = a.register(seen.append)
    assert a.has_observers() and not b.has_observers() and not cc.has_observers()
    a.emit("x")
    b.emit("y")
    handle.remove()
    handle.remove()  # idempotent
    a.emit("z")
    assert seen == ["x"] and not a.has_observers()
