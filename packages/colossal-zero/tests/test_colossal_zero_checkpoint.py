"""State: the full state dict loads into a plain model/optimizer, and a sharded checkpoint saved
through ``torch.distributed.checkpoint`` by stage 2 on 2 ranks resumes on 1 rank (stage 3) and on
4 ranks (stage 1) with the same losses as the uninterrupted run (fp32, 1e-5 relative)."""

import copy

import pytest
import torch.distributed as dist
from colossal_zero_testutil import global_batch, loss_of, make_model, make_optimizer, max_rel_err

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer

ROWS = 8  # global batch, the same for every world size
SAVE_AT, TOTAL = 2, 4


def _train(model, step_fn, start, stop):
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in range(start, stop):
        x, y = global_batch(step, ROWS)
        per = ROWS // world
        loss = loss_of(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        step_fn(loss)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _zero_step(zero):
    def fn(loss):
        zero.backward(loss)
        zero.step()
        zero.zero_grad()

    return fn


def save_run(path, stage):
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model), model, stage=stage, bucket_numel=2000)
    losses = _train(model, _zero_step(zero), 0, SAVE_AT)
    zero.save_sharded(path)
    return losses, zero.full_model_state_dict(), zero.state_dict()


def resume_run(path, stage):
    model = make_model(seed=123)  # a different init: everything must come from the checkpoint
    zero = ZeroOptimizer(make_optimizer(model), model, stage=stage, bucket_numel=1000)
    zero.load_sharded(path)
    return _train(model, _zero_step(zero), SAVE_AT, TOTAL), zero.full_model_state_dict()


def full_roundtrip(model_sd, opt_sd, stage):
    """Load a full (plain) state dict into a fresh ZeroOptimizer and continue."""
    model = make_model(seed=7)
    zero = ZeroOptimizer(make_optimizer(model), model, stage=stage)
    zero.load_full_model_state_dict(model_sd)
    zero.load_state_dict(opt_sd)
    return _train(model, _zero_step(zero), SAVE_AT, TOTAL)


def plain_run(start, stop, model_sd=None, opt_sd=None):
    model = make_model()
    opt = make_optimizer(model)
    if model_sd is not None:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
    losses = []
    for step in range(start, stop):
        x, y = global_batch(step, ROWS)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Stage 2 on 2 ranks for SAVE_AT steps, sharded checkpoint written; the reference run."""
    path = str(tmp_path_factory.mktemp("zero") / "ckpt")
    ref_losses, ref_sd = plain_run(0, TOTAL)
    out = run_distributed(save_run, 2, path, 2, timeout=120)
    return path, out[0], ref_losses, ref_sd


@pytest.mark.parametrize("world,load_stage", [(1, 3), (4, 1)])
def test_sharded_checkpoint_reshards(saved, world, load_stage):
    path, (losses, _, _), ref_losses, ref_sd = saved
    assert losses == pytest.approx(ref_losses[:SAVE_AT], rel=1e-5)
    for losses, sd in run_distributed(resume_run, world, path, load_stage, timeout=120):
        assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5), world
        assert max_rel_err(sd, ref_sd) < 1e-5


def test_full_state_dict_loads_into_plain_torch_and_back(saved):
    _, (_, model_sd, opt_sd), ref_losses, ref_sd = saved
    # plain torch continues exactly (torch.optim adopts the state tensors: give it a copy)
    losses, sd = plain_run(SAVE_AT, TOTAL, model_sd, copy.deepcopy(opt_sd))
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
    assert max_rel_err(sd, ref_sd) < 1e-5
    # and the full state dict loads back into ZeRO (stage 3 here) on 2 ranks
    for losses in run_distributed(full_roundtrip, 2, model_sd, opt_sd, 3, timeout=120):
        assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
