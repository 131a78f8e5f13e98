"""``overlap_param_gather``: stage 1/2 parameter all-gathers started at the end of ``step()`` and
waited per bucket in forward pre-hooks still train exactly like single-process training (1e-5
relative per tensor, as the parity tests), and leave the gathers pending between steps."""

import pytest
import torch.distributed as dist
from colossal_zero_testutil import loss_of, make_model, make_optimizer, max_rel_err, rank_batch, reference, run_cases

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroConfig, ZeroOptimizer

STEPS = 3


def test_overlapped_gathers_match_reference():
    cases = [dict(steps=STEPS, stage=s, overlap_param_gather=True, bucket_numel=500) for s in (1, 2)]
    ref, ref_losses = reference(STEPS, 2)
    for per_rank in run_distributed(run_cases, 2, cases, timeout=120):
        for sd, losses in per_rank:
            assert max_rel_err(sd, ref) < 1e-5
            assert losses == pytest.approx(ref_losses, rel=1e-5)


def _pending_between_steps():
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model), model, stage=2, overlap_param_gather=True, bucket_numel=500)
    x, y = rank_batch(0, 0, 1, dist.get_world_size(), dist.get_rank())
    zero.backward(loss_of(model, x, y))
    zero.step()
    after_step = len(zero._pending_gathers)
    model(x)  # every bucket's parameters are used in the forward: all waited
    after_forward = len(zero._pending_gathers)
    zero.step()  # no backward since: nothing new to reduce, still publishes
    zero.wait_params()
    return after_step, len(zero.flats), after_forward, len(zero._pending_gathers)


def test_gathers_stay_pending_until_the_forward_needs_them():
    for after_step, buckets, after_forward, after_wait in run_distributed(_pending_between_steps, 2, timeout=120):
        assert after_step == buckets > 1 and after_forward == 0 and after_wait == 0


def test_overlap_is_refused_for_stage_3():
    with pytest.raises(ValueError, match="overlap_param_gather applies to stages 1 and 2"):
        ZeroConfig(stage=3, overlap_param_gather=True)
