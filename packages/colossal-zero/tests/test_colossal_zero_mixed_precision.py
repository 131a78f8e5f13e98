"""Mixed precision (fp16 with the dynamic loss scaler of colossal.optim, bf16 unscaled, fp32
masters) and fault handling: an inf/NaN gradient on one rank skips the step on every rank and
leaves parameters, optimizer state and step counters unchanged."""

import pytest
import torch
import torch.distributed as dist
from colossal_zero_testutil import loss_of, make_model, make_optimizer, max_rel_err, rank_batch, reference, train_zero

from colossal.comm.testing import run_distributed
from colossal.optim import ConstantLossScaler, DynamicLossScaler
from colossal.zero import ZeroOptimizer

STEPS = 3


def fault_case(stage, dtype):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    zero = ZeroOptimizer(
        make_optimizer(model), model, stage=stage, param_dtype=dtype, hysteresis=1, initial_scale=1024.0
    )
    x, y = rank_batch(0, 0, 1, world, rank)
    zero.backward(loss_of(model, x, y))
    assert zero.step()
    before_params, before_opt = zero.full_model_state_dict(), zero.state_dict()
    scale = zero.scaler.scale
    loss = loss_of(model, x, y)
    if rank == 1:  # one bad element on one rank only
        next(model.blocks[0].mlp.parameters()).register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    zero.backward(loss)
    stepped = zero.step()
    after_params, after_opt = zero.full_model_state_dict(), zero.state_dict()
    same_params = all(torch.equal(before_params[k], after_params[k]) for k in before_params)
    same_opt = all(
        torch.equal(before_opt["state"][i][k], after_opt["state"][i][k])
        for i in before_opt["state"]
        for k in before_opt["state"][i]
    )
    return dict(stepped=stepped, same_params=same_params, same_opt=same_opt, scale=(scale, zero.scaler.scale),
                skipped=zero.skipped_steps, scaler=type(zero.scaler).__name__)  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
def test_fault_skips_step_everywhere(stage):
    out = run_distributed(fault_case, 2, stage, torch.float16, timeout=120)
    for r in out:
        assert r["stepped"] is False and r["skipped"] == 1
        assert r["same_params"] and r["same_opt"]
        assert r["scaler"] == DynamicLossScaler.__name__
        assert r["scale"] == (1024.0, 512.0)  # backed off once (hysteresis=1)


def test_fault_fp32_stage1():
    for r in run_distributed(fault_case, 2, 1, torch.float32, timeout=120):
        assert r["stepped"] is False and r["same_params"] and r["same_opt"]
        assert r["scaler"] == ConstantLossScaler.__name__


CASES = [(stage, dtype, False) for stage in (1, 2, 3) for dtype in (torch.float16, torch.bfloat16)]
CASES += [(2, torch.float16, True), (3, torch.bfloat16, True)]  # with CPU offload (fp32 masters on the CPU)
# Parameter tolerance: the working copy rounds to 2^-11 (fp16) / 2^-8 (bf16) relative, and Adam
# turns the resulting gradient noise into update noise of order lr on small-gradient elements
# (lr=1e-2 here, parameters ~0.02-0.1 in norm: this is relative error of the *updates*).
TOL = {torch.float16: 5e-2, torch.bfloat16: 1.5e-1}


def mixed_cases():
    return [
        train_zero(STEPS, stage=stage, param_dtype=dtype, offload=offload, kind="hybrid" if offload else "adamw")
        for stage, dtype, offload in CASES
    ]


def test_mixed_precision_tracks_fp32():
    """fp16/bf16 working weights with fp32 masters stay close to fp32 training."""
    ref, ref_losses = reference(STEPS, 2)
    for per_rank in run_distributed(mixed_cases, 2, timeout=180):
        for (stage, dtype, _), (sd, losses) in zip(CASES, per_rank, strict=True):
            assert max_rel_err(sd, ref) < TOL[dtype], (stage, dtype, max_rel_err(sd, ref))
            assert losses == pytest.approx(ref_losses, rel=TOL[dtype] / 10), (stage, dtype)
