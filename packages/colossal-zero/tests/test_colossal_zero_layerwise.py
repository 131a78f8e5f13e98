"""LAMB and LARS through ZeroOptimizer: per-parameter views of the master shards, whole-parameter
norms reduced over the shard group (see ``[Note: layer-wise optimizers]``).

Reference: single-process training with the same optimizer on the same global batch. Tolerance
1e-5 relative per tensor (fp32; the sharded norms add the same squares in another order)."""

import pytest
import torch
import torch.distributed as dist
from colossal_zero_testutil import (
    global_batch,
    loss_of,
    make_model,
    make_optimizer,
    max_rel_err,
    rank_batch,
    reference,
    run_cases,
)

from colossal.comm import Mesh
from colossal.comm.testing import run_distributed
from colossal.optim import Lamb, group_norm_reducer
from colossal.zero import ZeroOptimizer

STEPS = 3
CASES = [dict(steps=STEPS, kind=k, stage=s) for k in ("lamb", "lars") for s in (1, 2, 3)]
CASES += [dict(steps=STEPS, kind="lamb", stage=2, offload=True), dict(steps=STEPS, kind="lamb", stage=3, accum=2)]


def _check(per_rank, cases, world):
    refs = {}
    for i, case in enumerate(cases):
        key = (case["kind"], case.get("accum", 1))
        if key not in refs:
            refs[key] = reference(STEPS, world, accum=key[1], kind=key[0])
        ref, ref_losses = refs[key]
        for results in per_rank:
            sd, losses = results[i]
            assert max_rel_err(sd, ref) < 1e-5, case
            assert losses == pytest.approx(ref_losses, rel=1e-5), case


def test_layerwise_two_ranks_match_reference():
    _check(run_distributed(run_cases, 2, CASES, timeout=240), CASES, 2)


def _hsdp_and_four():
    mesh = Mesh(axes={"rep": 2, "shard": 2})
    groups = dict(group=mesh.group("shard"), replicate_group=mesh.group("rep"))
    return run_cases([dict(steps=STEPS, kind="lars", stage=3), dict(steps=STEPS, kind="lamb", stage=1, **groups)])


def test_layerwise_four_ranks_and_hsdp_match_reference():
    cases = [dict(kind="lars"), dict(kind="lamb")]
    _check(run_distributed(_hsdp_and_four, 4, timeout=240), cases, 4)


def _state_after_steps(stage):
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model, "lamb"), model, stage=stage)
    for step in range(STEPS):
        x, y = rank_batch(step, 0, 1, dist.get_world_size(), dist.get_rank())
        zero.backward(loss_of(model, x, y))
        zero.step()
        zero.zero_grad()
    return zero.state_dict(), zero.last_step_comm, zero.memory_stats()


def test_layerwise_state_dict_is_plain_lamb_state():
    model = make_model()
    opt = make_optimizer(model, "lamb")
    for step in range(STEPS):
        x, y = global_batch(step, 2 * 2)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()
    for stage in (2, 3):
        got, comm, mem = run_distributed(_state_after_steps, 2, stage, timeout=120)[0]
        assert set(got["state"]) == set(want["state"])
        for i, st in want["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][i][key], st[key], rtol=1e-5, atol=1e-8)
        # one all-reduce of 2 squared norms per parameter (fp32) joins the overflow flag and the
        # byte per parameter saying whether it got a gradient
        n_params = len(list(model.parameters()))
        assert comm["all_reduce"] == 4 + 2 * n_params * 4 + n_params
        assert mem["optimizer_states"] > 0


def _preset_reducer():
    model = make_model()
    opt = Lamb(model.parameters(), norm_reducer=group_norm_reducer(None))
    try:
        ZeroOptimizer(opt, model, stage=2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_preset_norm_reducer_is_refused():
    for msg in run_distributed(_preset_reducer, 2, timeout=60):
        assert "norm_reducer is already set" in msg


def _lars_resume(stage, path, sharded):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model, "lars"), model, stage=stage)

    def train(z, m, steps):
        for step in steps:
            x, y = rank_batch(step, 0, 1, world, rank)
            z.backward(loss_of(m, x, y))
            z.step()
            z.zero_grad()

    train(zero, model, range(3))
    if sharded:
        zero.save_sharded(path)
    osd, msd = zero.state_dict(), zero.full_model_state_dict()
    model2 = make_model(seed=1)
    zero2 = ZeroOptimizer(make_optimizer(model2, "lars"), model2, stage=stage)
    if sharded:
        zero2.load_sharded(path)
    else:
        zero2.load_full_model_state_dict(msd)
        zero2.load_state_dict(osd)
    train(zero2, model2, range(3, 5))
    return zero2.full_model_state_dict()


@pytest.mark.parametrize("stage,sharded", [(1, False), (3, True)])
def test_lars_resumes_exactly(tmp_path, stage, sharded):
    # LARS keeps a per-parameter scalar (the scale of its momentum buffer): a checkpoint must keep
    # one per parameter, not the first parameter's for all of them.
    ref, _ = reference(5, 2, kind="lars")
    got = run_distributed(_lars_resume, 2, stage, str(tmp_path / "ckpt"), sharded, timeout=120)[0]
    assert max_rel_err(got, ref) < 1e-5
