"""Differentiable collectives: forward and gradients equal a single-process reference.

Each rank builds the *global* computation in one process (every rank's inputs are seeded by
rank) and differentiates it with autograd; the distributed version must give this rank's slice
of the same forward values and gradients. fp64 throughout, so 1e-12 tolerances are exact up to
summation order.
"""

import pytest
import torch
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import run_distributed


def _t(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _leaf(x):
    return x.clone().requires_grad_(True)


def grads_match() -> bool:
    n, r = dist.get_world_size(), dist.get_rank()
    w = [_t(100 + s, 3, 2 * n) for s in range(n)]  # per-rank loss weights
    full = _t(7, 3, 2 * n)  # replicated input

    # copy_to_group: identity forward, gradient = sum of every rank's upstream gradient.
    x = _leaf(full)
    (cc.copy_to_group(x) * w[r]).sum().backward()
    _check(x.grad, sum(w))

    # reduce_from_group: y = sum_s x_s; every rank applies the same loss -> dx_r = upstream.
    x = _leaf(_t(200 + r, 3, 2 * n))
    y = cc.reduce_from_group(x)
    _check(y, sum(_t(200 + s, 3, 2 * n) for s in range(n)))
    (y * w[0]).sum().backward()
    _check(x.grad, w[0])

    # split: replicated x, rank r keeps chunk r; total gradient of x = cat of per-rank weights.
    x = _leaf(full)
    y = cc.split_along_dim(x, dim=1)
    _check(y, full.chunk(n, 1)[r])
    (y * w[r].chunk(n, 1)[r]).sum().backward()
    _check(x.grad, torch.cat([w[s].chunk(n, 1)[s] for s in range(n)], 1))

    # gather (split backward): the same loss on all ranks -> dx_r = chunk r of the weight.
    x = _leaf(full.chunk(n, 1)[r])
    y = cc.gather_along_dim(x, dim=1)
    _check(y, full)
    (y * w[0]).sum().backward()
    _check(x.grad, w[0].chunk(n, 1)[r])

    # all_gather (reduce-scatter backward): per-rank losses -> dx_r = chunk r of sum of weights.
    x = _leaf(full.chunk(n, 1)[r])
    (cc.all_gather_along_dim(x, dim=1) * w[r]).sum().backward()
    _check(x.grad, sum(w).chunk(n, 1)[r])

    # reduce_scatter (all-gather backward).
    xs = [_t(300 + s, 3, 2 * n) for s in range(n)]
    x = _leaf(xs[r])
    y = cc.reduce_scatter_along_dim(x, dim=1)
    _check(y, sum(xs).chunk(n, 1)[r])
    (y * w[r].chunk(n, 1)[r]).sum().backward()
    _check(x.grad, torch.cat([w[s].chunk(n, 1)[s] for s in range(n)], 1))

    # all_to_all: global X (4n, 2n) is row-split; after the switch rank r holds column chunk r.
    X = _leaf(_t(400, 4 * n, 2 * n))
    loss = sum((X.chunk(n, 1)[s] * w[s][:, :2].repeat(4 * n // 3 + 1, 1)[: 4 * n]).sum() for s in range(n))
    loss.backward()
    x = _leaf(X.detach().chunk(n, 0)[r])
    y = cc.all_to_all_along_dims(x, scatter_dim=1, gather_dim=0)
    _check(y, X.detach().chunk(n, 1)[r])
    (y * w[r][:, :2].repeat(4 * n // 3 + 1, 1)[: 4 * n]).sum().backward()
    _check(x.grad, X.grad.chunk(n, 0)[r])
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_differentiable_collectives_gradients(world_size):
    assert run_distributed(grads_match, world_size) == [True] * world_size


def indivisible() -> str:
    try:
        cc.split_along_dim(torch.ones(3, 5), dim=1)
    except ValueError as e:
        return str(e)
    return ""


def test_indivisible_split_names_sizes():
    assert "(3, 5) along dim 1 must be divisible by the group size 2" in run_distributed(indivisible, 2)[0]
