"""Expert parallelism on 2 and 4 gloo ranks equals one process holding every expert.

Each rank routes its own batch; the reference runs the dense MoE (all experts) on every rank's
batch in turn and sums the losses, so its gradients are the sum over ranks. After
``reduce_gradients`` (average over data parallelism) they must equal the reference's / D.
"""

import pytest
import torch
import torch.distributed as dist
from moe_testing import assert_close, reference_keep

import colossal.comm as cc
from colossal.comm.testing import run_distributed
from colossal.moe import MoE, MoEConfig, expert_groups, expert_parameters, reduce_gradients

N, C, F, E = 24, 16, 32, 8

CASES = [
    dict(top_k=1, capacity_factor=1.0),
    dict(top_k=2, capacity_factor=1.0, expert="swiglu"),
    dict(top_k=1, capacity_factor=None, expert="swiglu"),
    dict(top_k=2, capacity_factor=None),
    dict(top_k=1, capacity_factor=1.0, skew=True),  # every token to expert 0, the last expert idle
    dict(top_k=2, capacity_factor=None, skew=True),
]


def _inputs(world: int, skew: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(N, C, generator=gen) for _ in range(world)]
    if skew:
        for x in xs:
            x[:, 0] = 4.0  # a constant feature the skewed gate reads
    return xs, [torch.randn(N, C, generator=gen) for _ in range(world)]


def _dense_moe(case: dict) -> MoE:
    case = dict(case)
    skew = case.pop("skew", False)
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden=C, ffn_hidden=F, num_experts=E, min_capacity=1, **case))
    if skew:
        with torch.no_grad():
            moe.router.gate.weight[:, 0] = 0.0
            moe.router.gate.weight[0, 0] = 5.0  # expert 0 always first
            moe.router.gate.weight[E - 1, 0] = -5.0  # expert E-1 never chosen
    return moe


def _reference(dense: MoE, xs, gys):
    """Outputs, aux losses, dropped counts and input grads per rank; parameter grads summed."""
    outs, auxes, dropped, gxs = [], [], [], []
    dense.zero_grad()
    for x, gy in zip(xs, gys):
        x = x.clone().requires_grad_()
        y = dense(x)
        ((y * gy).sum() + dense.aux_loss).backward()
        routing = dense.router(x.detach())
        keep = reference_keep(routing.expert, E, routing.capacity)
        outs.append(y.detach()), auxes.append(dense.aux_loss.detach()), gxs.append(x.grad)
        dropped.append(int((~keep).sum()))
    return outs, auxes, dropped, gxs, {n: p.grad.clone() for n, p in dense.named_parameters()}


def _expected_a2a_bytes(dense: MoE, xs, groups, rank: int) -> dict[str, int]:
    """Bytes of this rank's dispatch/combine per the note's formula, from the routing counts."""
    ep, el = groups.ep_size, E // groups.ep_size
    first = rank - rank % ep  # the ep group holds ranks first .. first + ep - 1
    counts = []
    for r in range(first, first + ep):
        routing = dense.router(xs[r])
        counts.append(routing.expert_counts(E))  # kept assignments per expert
    me = rank % ep
    sent = int(counts[me].sum())
    recv = sum(int(c[me * el : (me + 1) * el].sum()) for c in counts)
    row = C * 4
    return {
        "moe.counts": 8 * E,
        "moe.dispatch": sent * row,
        "moe.combine": recv * row,
        "moe.combine.backward": sent * row,
        "moe.dispatch.backward": recv * row,
    }


def _parity(ep_size: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = expert_groups(ep_size)
    seen = []
    for case in CASES:
        dense = _dense_moe(case)
        xs, gys = _inputs(world, case.get("skew", False))
        outs, auxes, dropped, gxs, grads = _reference(dense, xs, gys)
        moe = MoE.from_dense(dense, groups.ep)
        x = xs[rank].clone().requires_grad_()
        counter = cc.CommCounter()
        with cc.register_observer(counter):
            y = moe(x)
            ((y * gys[rank]).sum() + moe.aux_loss).backward()
        what = f"{case} rank {rank}"
        assert_close(y, outs[rank], f"output {what}")
        assert_close(moe.aux_loss, auxes[rank], f"aux loss {what}")
        assert_close(x.grad, gxs[rank], f"input grad {what}")
        assert moe.stats.dropped == dropped[rank], f"dropped {what}: {moe.stats.dropped} != {dropped[rank]}"
        expected = _expected_a2a_bytes(dense, xs, groups, rank)
        assert {t: counter.by_tag[t] for t in expected} == expected, f"all-to-all bytes {what}"
        reduce_gradients(moe, groups)
        assert_close(moe.router.gate.weight.grad, grads["router.gate.weight"] / world, f"router grad {what}")
        sl = slice(moe.local_experts.start, moe.local_experts.stop)
        for n, p in moe.experts.named_parameters():
            assert_close(p.grad, grads[f"experts.{n}"][sl] / world, f"expert grad {n} {what}")
        if case.get("skew"):
            assert dense.stats.expert_counts[E - 1] == 0 and moe.stats.expert_counts[0] > 0
        seen.append(f"{case}")
    assert len(expert_parameters(moe)) == (4 if moe.config.expert == "mlp" else 3)
    return seen


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)], ids=["ep2", "ep4", "ep2xedp2"])
def test_expert_parallel_equals_single_process(world, ep):
    results = run_distributed(_parity, world, ep, timeout=120)
    assert all(len(r) == len(CASES) for r in results)


def _errors() -> None:
    with pytest.raises(ValueError, match="ep_size=3 does not divide the data-parallel world size 4"):
        expert_groups(3)
    groups = expert_groups(4)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert-parallel size ep=4"):
        MoE(MoEConfig(hidden=C, ffn_hidden=F, num_experts=6), groups.ep)


def test_errors_raise_on_every_rank_before_any_collective():
    run_distributed(_errors, 4, timeout=60)


def _sub_group_layout() -> None:
    mesh = cc.Mesh(axes={"dp": 2, "tp": 2})  # dp groups {0, 2} and {1, 3}
    groups = expert_groups(2, mesh.group("dp"))
    rank = dist.get_rank()
    assert cc.group_ranks(groups.ep) == ((0, 2) if rank % 2 == 0 else (1, 3))
    assert cc.group_ranks(groups.edp) == (rank,) and groups.dp_size == 2
    x = torch.full((1,), float(rank))
    cc.all_reduce(x, group=groups.ep)
    assert x.item() == (2.0 if rank % 2 == 0 else 4.0)


def test_expert_groups_inside_a_data_parallel_sub_group():
    run_distributed(_sub_group_layout, 4, timeout=60)
