"""Sharded LAMB/LARS (norm_reducer) on 2 and 4 ranks against the unsharded optimizer.

Each rank holds a random uneven contiguous shard of every flattened parameter (some empty).
Tolerance 1e-5 relative (fp32): the sharded norms add the same squares in another order.
"""

import pytest
import torch
import torch.distributed as dist
from _colossal_optim_helpers import make_grads, make_params, my_shard, shard_bounds

from colossal.comm.testing import run_distributed
from colossal.optim import CPUAdam, Lamb, Lars, group_norm_reducer

STEPS = 4
KWARGS = {"Lamb": dict(lr=0.02, weight_decay=0.05), "Lars": dict(lr=1.0, weight_decay=1e-3, eta=0.02)}


def _groups(params):
    return [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0, "trust_ratio": False}]


def _train(cls_name: str, params, grads_by_step, reducer=None, shard=lambda t: t):
    cls = {"Lamb": Lamb, "Lars": Lars}[cls_name]
    opt = cls(_groups(params), norm_reducer=reducer, **KWARGS[cls_name])
    for grads in grads_by_step:
        for p, g in zip(params, grads):
            p.grad = shard(g)
        opt.step()
    return [p.detach().clone() for p in params]


def _sharded_rank(cls_name: str, seed: int) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    full = make_params(seed, torch.float32)
    bounds = [shard_bounds(t.numel(), world, gen) for t in full]
    params = [torch.nn.Parameter(my_shard(t, rank, b)) for t, b in zip(full, bounds)]
    grads_by_step = [make_grads(seed, t, torch.float32) for t in range(STEPS)]
    it = iter(range(10**9))

    def shard(g):
        i = next(it) % len(full)
        return my_shard(g, rank, bounds[i])

    return _train(cls_name, params, grads_by_step, group_norm_reducer(None), shard)


def _both_sharded(seed: int) -> dict[str, list[torch.Tensor]]:
    return {name: _sharded_rank(name, seed) for name in ("Lamb", "Lars")}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.timeout(150)
def test_sharded_matches_unsharded(world_size):
    seed = 7 + world_size
    results = run_distributed(_both_sharded, world_size, seed, timeout=120)
    for cls_name in ("Lamb", "Lars"):
        _compare(cls_name, [r[cls_name] for r in results], seed, world_size)


def _compare(cls_name, shards, seed, world_size):
    full = make_params(seed, torch.float32)
    ref = _train(
        cls_name,
        [torch.nn.Parameter(t.clone()) for t in full],
        [make_grads(seed, t, torch.float32) for t in range(STEPS)],
    )
    for i, r in enumerate(ref):
        got = torch.cat([shards[rank][i] for rank in range(world_size)]).view_as(r)
        torch.testing.assert_close(got, r, rtol=1e-5, atol=1e-6)
        assert not torch.equal(r, full[i]) or i == 3  # the update is not a no-op (3 has zero grads and no decay)


def _unsharded_with_reducer_differs() -> float:
    # Without the reducer each rank would use only its shard's norm: check that this matters.
    rank = dist.get_rank()
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]) if rank == 0 else torch.tensor([12.0]))
    p.grad = torch.ones_like(p)
    Lars([p], lr=1.0, momentum=0.0, eta=1.0, eps=0.0, norm_reducer=group_norm_reducer(None)).step()
    return float(p[0])


@pytest.mark.timeout(60)
def test_reducer_uses_whole_parameter_norm():
    out = run_distributed(_unsharded_with_reducer_differs, 2, timeout=45)
    ratio = 13.0 / 3**0.5  # ||w|| = 13 over both ranks, ||g|| = sqrt(3)
    assert out[0] == pytest.approx(3.0 - ratio, rel=1e-6)
    assert out[1] == pytest.approx(12.0 - ratio, rel=1e-6)


@pytest.mark.parametrize("cls", [Lamb, Lars, CPUAdam])
def test_views_of_an_engine_buffer_are_never_moved(cls):
    # ZeRO hands a parameter that fills its whole master shard as ``master[0:n]``: flattening must
    # leave such views in place, or the updates would no longer reach the engine's buffer.
    master = torch.randn(12)
    whole, part = master[0:12], torch.randn(20)[2:7]
    for view in (whole, part):
        before = view.clone()
        view.grad = torch.randn_like(view)
        cls([view], lr=0.1).step()
        assert view._base is not None and not torch.equal(view, before)
    assert torch.equal(master, whole)  # the update landed in the base buffer


def test_a_reused_address_is_not_mistaken_for_a_flat_buffer():
    # A flat buffer is remembered by its storage object, not its address: once it is freed, an
    # unrelated buffer allocated at the same address must not count as ours (and be flattened).
    import weakref

    from colossal.optim import _flat

    foreign, gone = torch.zeros(64), torch.zeros(64)
    _flat._OWN_STORAGES[foreign.untyped_storage().data_ptr()] = weakref.ref(gone.untyped_storage())
    assert not _flat.in_flat_buffer(foreign[:32]) and not _flat.flattenable(foreign[:32])
    del _flat._OWN_STORAGES[foreign.untyped_storage().data_ptr()]
    opt = Lamb([torch.nn.Parameter(torch.randn(40))], lr=0.1)
    opt.param_groups[0]["params"][0].grad = torch.randn(40)
    opt.step()
    assert _flat.in_flat_buffer(opt.param_groups[0]["params"][0])  # moved into a buffer of ours
