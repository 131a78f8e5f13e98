"""Every collective against a single-process reference, on 2, 4 and 8 ranks.

Each rank can rebuild every other rank's input (seeded per rank), so the reference is computed
locally in float64 and compared with what the collective returned. Tolerances: exact for
integers and for data movement (gather, all-to-all, broadcast, p2p); for float reductions the
summation order differs from the reference (ring vs sequential), hence 1e-6 relative for
fp32/fp64; bf16 inputs are small integers whose sums are exact, so bf16 is compared exactly.
"""

import pytest
import torch
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import run_distributed

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
SHAPES = [(7,), (3, 5), (2, 3, 5)]


def _input(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 * salt + len(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10
    # Integers (|x| < 32) for int64 and bf16: sums of up to 8 of them are exact in bf16, so the
    # reduction order cannot matter and the comparison is exact.
    return x.round().clamp(-31, 31).to(dtype) if dtype in (torch.int64, torch.bfloat16) else x.to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = {torch.float32: 1e-6, torch.float64: 1e-6}.get(actual.dtype, 0.0)
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol, atol=tol * 10, msg=lambda m: f"{what} {actual.dtype}: {m}"
    )


def _reductions(n, r, shape, dtype, async_op):
    xs = [_input(s, shape, dtype) for s in range(n)]
    ref = torch.stack([x.double() for x in xs]).sum(0)
    out = cc.all_reduce(xs[r].clone(), async_op=async_op)
    out = out.wait() if async_op else out
    _close(out, ref, f"all_reduce {dtype} {shape}")
    _close(cc.all_reduce(xs[r].clone(), op="max"), torch.stack([x.double() for x in xs]).max(0).values, "max")
    red = cc.reduce(xs[r].clone(), dst=n - 1)
    if r == n - 1:
        _close(red, ref, "reduce")
    big = [_input(s, (n * 3, *shape), dtype, 1) for s in range(n)]
    rs_ref = torch.stack([b.double() for b in big]).sum(0).chunk(n, 0)[r]
    _close(_wait(cc.reduce_scatter(big[r], async_op=async_op)), rs_ref, "reduce_scatter")
    # gloo's in-place all-reduce path ([Note: gloo fast paths]): same result, input given up
    scratch = big[r].clone()
    _close(_wait(cc.reduce_scatter(scratch, async_op=async_op, destroy_input=True)), rs_ref, "rs destroy_input")
    mx = cc.reduce_scatter(big[r].clone(), op="max", destroy_input=True)
    _close(mx, torch.stack([b.double() for b in big]).max(0).values.chunk(n, 0)[r], "rs max destroy_input")
    if len(shape) > 1:
        big = [_input(s, (*shape[:-1], n * 2), dtype, 2) for s in range(n)]
        ref1 = torch.stack([b.double() for b in big]).sum(0).chunk(n, -1)[r]
        _close(cc.reduce_scatter(big[r], dim=-1), ref1, "rs dim -1")


def _wait(x):
    return x.wait() if isinstance(x, cc.CommHandle) else x


def _movement(n, r, shape, dtype, async_op):
    xs = [_input(s, shape, dtype) for s in range(n)]
    for dim in range(len(shape)):
        got = _wait(cc.all_gather(xs[r], dim=dim, async_op=async_op))
        assert torch.equal(got, torch.cat(xs, dim=dim)), f"all_gather dim {dim}"
    assert all(torch.equal(a, b) for a, b in zip(cc.all_gather_list(xs[r]), xs, strict=True))
    b = xs[r].clone()
    assert torch.equal(_wait(cc.broadcast(b, src=1 % n, async_op=async_op)), xs[1 % n])
    rows = [_input(s, (n * 2, *shape[1:]), dtype, 3) for s in range(n)]
    got = _wait(cc.all_to_all(rows[r], async_op=async_op))
    assert torch.equal(got, torch.cat([rows[s].chunk(n, 0)[r] for s in range(n)])), "all_to_all even"


def _split(s: int, d: int) -> int:
    return (s + 2 * d) % 3 + 1  # rows rank s sends to rank d (uneven, never zero)


def _uneven_all_to_all(n, r, dtype):
    def data(s):
        return _input(s, (sum(_split(s, d) for d in range(n)), 4), dtype, 4)

    ins, outs = [_split(r, d) for d in range(n)], [_split(s, r) for s in range(n)]
    got = cc.all_to_all(data(r), output_split_sizes=outs, input_split_sizes=ins)
    expected = torch.cat([data(s).split([_split(s, d) for d in range(n)])[r] for s in range(n)])
    assert torch.equal(got, expected), "all_to_all uneven"


def _p2p(n, r, dtype):
    xs = [_input(s, (5, 3), dtype, 5) for s in range(n)]
    assert torch.equal(cc.ring_exchange(xs[r]), xs[(r - 1) % n]), "ring +1"
    assert torch.equal(cc.ring_exchange(xs[r], shift=-1), xs[(r + 1) % n]), "ring -1"
    buf = torch.empty_like(xs[0])
    ops = [cc.P2POp("send", xs[r], (r + 1) % n), cc.P2POp("recv", buf, (r - 1) % n)]
    cc.batch_p2p(ops)
    assert torch.equal(buf, xs[(r - 1) % n]), "batch_p2p"
    if r == 0:
        cc.send(xs[0], dst=n - 1)
    elif r == n - 1:
        assert torch.equal(cc.recv(torch.empty_like(xs[0]), src=0), xs[0]), "send/recv"


def check_all(async_op: bool) -> bool:
    n, r = dist.get_world_size(), dist.get_rank()
    for dtype in DTYPES:
        for shape in SHAPES:
            _reductions(n, r, shape, dtype, async_op)
            _movement(n, r, shape, dtype, async_op)
        _uneven_all_to_all(n, r, dtype)
        _p2p(n, r, dtype)
    return True


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_collectives_match_reference(world_size):
    assert run_distributed(check_all, world_size, False, timeout=120) == [True] * world_size


def test_async_forms_match_reference():
    assert run_distributed(check_all, 4, True, timeout=120) == [True] * 4


def subgroup_collectives() -> list[int]:
    """Collectives on a sub-group use group ranks for src/dst and touch only members."""
    r = dist.get_rank()
    odd = dist.new_group([1, 3])
    even = dist.new_group([0, 2])
    group = odd if r % 2 else even
    t = torch.tensor([float(r)])
    cc.broadcast(t, src=1, group=group)  # group rank 1 = global 3 (odd) or 2 (even)
    gathered = cc.all_gather(torch.tensor([r]), group=group)
    return [int(t.item()), *gathered.tolist()]


def test_subgroups_use_group_ranks():
    assert run_distributed(subgroup_collectives, 4) == [[2, 0, 2], [3, 1, 3], [2, 0, 2], [3, 1, 3]]


def bad_arguments() -> list[str]:
    errors = []
    for call in (
        lambda: cc.all_reduce([1, 2]),
        lambda: cc.all_reduce(torch.ones(2), op="mean"),
        lambda: cc.reduce_scatter(torch.ones(3)),
        lambda: cc.all_gather(torch.ones(2), dim=3),
        lambda: cc.broadcast(torch.ones(2), src=5),
        lambda: cc.all_to_all(torch.ones(4), output_split_sizes=[1, 3], input_split_sizes=[2, 1]),
        lambda: cc.batch_p2p([cc.P2POp("put", torch.ones(1), 0)]),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    return errors


def test_bad_arguments_raise_before_communicating():
    out = run_distributed(bad_arguments, 2)
    assert out[0] == out[1] == ["TypeError"] + ["ValueError"] * 6


def gather_and_scatter_into_out() -> bool:
    n, r = dist.get_world_size(), dist.get_rank()
    xs = [_input(s, (3, 2), torch.float32) for s in range(n)]
    buf = torch.full((3 * n, 2), -1.0)
    assert cc.all_gather(xs[r], out=buf) is buf and torch.equal(buf, torch.cat(xs))
    big = [_input(s, (2 * n, 3), torch.float64, 6) for s in range(n)]
    shard = torch.empty(2, 3, dtype=torch.float64)
    handle = cc.reduce_scatter(big[r], out=shard, async_op=True)
    assert handle.wait() is shard
    _close(shard, sum(big).chunk(n, 0)[r], "reduce_scatter out")
    errors = []
    for call in (
        lambda: cc.all_gather(xs[r], out=torch.empty(3 * n, 3)),
        lambda: cc.reduce_scatter(big[r], out=torch.empty(2, 3)),  # float32 for float64 input
    ):
        try:
            call()
        except ValueError as e:
            errors.append("out must be a contiguous" in str(e))
    return errors == [True, True]


def test_all_gather_and_reduce_scatter_into_caller_buffers():
    assert run_distributed(gather_and_scatter_into_out, 2) == [True, True]
