"""grad_norm / clip_grad_norm_ / has_inf_or_nan, single process and sharded over 2 and 4 ranks.

Reference: ``torch.nn.utils.clip_grad_norm_`` on the unsharded gradients. Tolerance 1e-6
relative: the sharded sum adds the same fp32 per-tensor norms in a different order.
"""

import math

import pytest
import torch
import torch.distributed as dist

from colossal.comm.testing import run_distributed
from colossal.optim import DynamicLossScaler, clip_grad_norm_, grad_norm, group_norm_reducer, has_inf_or_nan

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (16, 3), (0,)]


def _full_grads(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sharded = [torch.randn(s, generator=gen) * (i + 1) for i, s in enumerate(SHAPES)]
    replicated = [torch.randn(6, generator=gen), torch.randn(2, 2, generator=gen) * 10]
    return sharded, replicated


def _split_points(numel: int, world: int, gen: torch.Generator) -> list[int]:
    """Random uneven contiguous cut of ``numel`` elements into ``world`` pieces (some may be empty)."""
    cuts = sorted(torch.randint(0, numel + 1, (world - 1,), generator=gen).tolist())
    return [0, *cuts, numel]


def _my_shards(full: list[torch.Tensor], rank: int, world: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    shards = []
    for t in full:
        b = _split_points(t.numel(), world, gen)
        shards.append(t.reshape(-1)[b[rank] : b[rank + 1]].clone())
    return shards


def _reference(sharded, replicated, max_norm, norm_type):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in sharded + replicated]
    for p, g in zip(params, sharded + replicated):
        p.grad = g.clone()
    nonempty = [p for p in params if p.numel()]  # torch's inf-norm refuses empty tensors
    total = torch.nn.utils.clip_grad_norm_(nonempty, max_norm, norm_type)
    return total, [p.grad for p in params]


def _check_sharded_clip(seed: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    full, replicated_full = _full_grads(seed)
    totals = []
    for norm_type in (2.0, 1.0, math.inf, 3.0):
        for max_norm in (1.0, 1e6):  # clipping and not clipping
            shards = _my_shards(full, rank, world, seed)
            replicated = [t.clone() for t in replicated_full]
            ref_total, ref_grads = _reference(full, replicated_full, max_norm, norm_type)
            norm = grad_norm(shards, norm_type, replicated=replicated)
            total = clip_grad_norm_(shards, max_norm, norm_type, replicated=replicated)
            torch.testing.assert_close(norm, ref_total, rtol=1e-6, atol=0)
            torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
            ref_shards = _my_shards(ref_grads[: len(full)], rank, world, seed)
            for got, want in zip(shards + replicated, ref_shards + ref_grads[len(full) :]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            totals.append(total.item())
    return totals


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.timeout(120)
def test_sharded_clip_matches_torch(world_size):
    results = run_distributed(_check_sharded_clip, world_size, 1234, timeout=90)
    assert all(r == results[0] for r in results), "total norm differs across ranks"


def _overflow_on_one_rank(bad_rank: int, value: float) -> tuple[bool, bool, float, bool]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    param = torch.nn.Parameter(torch.randn(10))
    before = param.detach().clone()
    param.grad = torch.randn(10)
    clean = has_inf_or_nan([param.grad])
    if rank == bad_rank:
        param.grad[3] = value
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=1)
    found = has_inf_or_nan([param.grad])
    if not found:  # the engine's skip: every rank agrees, so every rank skips
        opt.step()
    scaler.update(found)
    return clean, found, scaler.scale, torch.equal(param.detach(), before)


def _overflow_cases(cases) -> list:
    return [_overflow_on_one_rank(bad_rank, value) for bad_rank, value in cases]


@pytest.mark.timeout(120)
def test_overflow_on_one_rank_skips_everywhere():
    cases = [(1, math.inf), (2, math.nan), (0, -math.inf)]
    results = run_distributed(_overflow_cases, 4, cases, timeout=90)
    for rank_results in results:
        for clean, found, scale, unchanged in rank_results:
            assert clean is False
            assert found is True
            assert scale == 512.0
            assert unchanged


def _reduce_sq_norms() -> list[float]:
    rank = dist.get_rank()
    reducer = group_norm_reducer(None)
    out = reducer(torch.tensor([float(rank), 1.0, 0.0]))
    return out.tolist()


@pytest.mark.timeout(60)
def test_group_norm_reducer_sums_over_group():
    results = run_distributed(_reduce_sq_norms, 4, timeout=45)
    assert results == [[6.0, 4.0, 0.0]] * 4


def _custom_all_reduce() -> tuple[list[str], float, bool, list[float]]:
    """Every communicating function routes its reduction through ``all_reduce=`` when given."""
    seen: list[str] = []

    def counting(tensor, op, group):
        seen.append(str(op).rsplit(".", 1)[-1])
        return dist.all_reduce(tensor, op=op, group=group)

    rank = dist.get_rank()
    g = [torch.full((3,), float(rank + 1))]
    norm = clip_grad_norm_(g, 100.0, all_reduce=counting).item()
    found = has_inf_or_nan([torch.tensor([math.inf if rank == 1 else 0.0])], all_reduce=counting)
    sq = group_norm_reducer(None, all_reduce=counting)(torch.tensor([1.0]))
    grad_norm(g, math.inf, all_reduce=counting)
    return seen, norm, found, sq.tolist()


@pytest.mark.timeout(60)
def test_all_reduce_hook_carries_every_reduction():
    for seen, norm, found, sq in run_distributed(_custom_all_reduce, 2, timeout=45):
        assert [s.upper() for s in seen] == ["SUM", "MAX", "SUM", "MAX"]
        assert norm == pytest.approx(math.sqrt(3 * 1 + 3 * 4))
        assert found is True and sq == [2.0]


def test_all_reduce_hook_must_be_callable():
    with pytest.raises(TypeError, match="all_reduce must be callable"):
        has_inf_or_nan([torch.ones(2)], all_reduce=3)
    with pytest.raises(TypeError, match="all_reduce must be callable"):
        group_norm_reducer(None, all_reduce="sum")


def test_single_process_matches_torch_mixed_dtypes():
    grads = [torch.randn(8, 3), torch.randn(5, dtype=torch.float64), torch.randn(4, dtype=torch.bfloat16)]
    for norm_type in (2.0, 1.0, math.inf):
        ref = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]), norm_type)
        got = grad_norm(grads, norm_type)
        assert got.dtype == torch.float32 and got.dim() == 0
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)


def test_empty_and_zero():
    assert grad_norm([]).item() == 0.0
    assert grad_norm([torch.zeros(3)], math.inf).item() == 0.0
    g = torch.zeros(4)
    assert clip_grad_norm_([g], 1.0).item() == 0.0
    assert torch.equal(g, torch.zeros(4))


def test_nonfinite_propagates():
    nan_grads = [torch.tensor([1.0, math.nan]), torch.ones(2)]
    inf_grads = [torch.tensor([1.0, math.inf]), torch.ones(2)]
    for p in (2.0, 1.0, math.inf):
        assert grad_norm(nan_grads, p).isnan()
        assert grad_norm(inf_grads, p).isinf()
    assert has_inf_or_nan(nan_grads) and has_inf_or_nan(inf_grads)
    assert not has_inf_or_nan([torch.ones(3, dtype=torch.float16) * 60000])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(nan_grads, 1.0, error_if_nonfinite=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm([torch.ones(2)], 0.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_([torch.ones(2)], -1.0)
    with pytest.raises(TypeError, match="sparse"):
        grad_norm([torch.ones(2).to_sparse()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_has_inf_or_nan_single_process(dtype):
    """Agrees with ``isfinite`` element by element, including finite tensors whose sum overflows (the
    fast sum check must fall back to the elements) and infinities of both signs that sum to NaN."""
    big = torch.finfo(dtype).max
    cases = [
        ([torch.randn(7, 5).to(dtype), torch.randn(13).to(dtype)], False),
        ([torch.full((4,), big, dtype=dtype)], False),  # finite, the sum overflows
        ([torch.randn(6).to(dtype), torch.tensor([1.0, math.inf, 2.0], dtype=dtype)], True),
        ([torch.tensor([math.inf, -math.inf], dtype=dtype)], True),
        ([torch.tensor([0.0, math.nan], dtype=dtype), torch.zeros(0, dtype=dtype)], True),
        ([torch.zeros(0, dtype=dtype)], False),
    ]
    for tensors, want in cases:
        assert want == (not all(bool(t.isfinite().all()) for t in tensors))
        assert has_inf_or_nan(tensors) is want
