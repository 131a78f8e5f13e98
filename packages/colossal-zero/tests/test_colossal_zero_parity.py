"""Stage 1/2/3 fp32 parity with single-process training on the same global batch, with and
without CPU offload (all of it, or half the buffers: ``offload_optim_frac=0.5``), gradient
accumulation, clipping and a deeper stage-3 prefetch, on 2 and 4 ranks.

Tolerance: 1e-5 relative (Frobenius norm per tensor). The data-parallel gradient is a sum of
per-rank means, the reference a mean over the whole batch: the two differ by fp32 rounding
(~1e-7 relative) which a few AdamW steps do not amplify beyond ~1e-6.
"""

import pytest
from colossal_zero_testutil import max_rel_err, reference, run_cases

from colossal.comm.testing import run_distributed

STEPS = 3


def _check(out, cases, world):
    for i, case in enumerate(cases):
        ref, ref_losses = reference(
            case["steps"],
            world,
            accum=case.get("accum", 1),
            clip=case.get("max_grad_norm"),
            kind=case.get("kind", "adamw"),
        )
        for rank_results in out:
            sd, losses = rank_results[i]
            assert max_rel_err(sd, ref) < 1e-5, case
            assert losses == pytest.approx(ref_losses, rel=1e-5), case


@pytest.mark.parametrize("world", [2, 4])
def test_parity_stages_fp32(world):
    """Every stage, plain, with offload, with accumulation (no_sync and repeated backward), clipping."""
    cases = [
        dict(steps=STEPS, stage=1, bucket_numel=3000),
        dict(steps=STEPS, stage=2, bucket_numel=3000),
        dict(steps=STEPS, stage=3),
        dict(steps=STEPS, stage=1, offload=True, accum=2, use_no_sync=True, max_grad_norm=0.05),
        dict(steps=STEPS, stage=2, offload=True, accum=2, max_grad_norm=0.05, kind="hybrid"),
        dict(steps=STEPS, stage=3, offload=True, accum=2, use_no_sync=True, max_grad_norm=0.05),
        dict(steps=STEPS, stage=2, offload_optim_frac=0.5, bucket_numel=3000, max_grad_norm=0.05, kind="hybrid"),
        dict(steps=STEPS, stage=3, offload_optim_frac=0.5, prefetch=2, max_grad_norm=0.05),
        dict(steps=STEPS, stage=3, accum=2, kind="sgd"),
        dict(steps=STEPS, stage=2, accum=3, use_no_sync=True, kind="sgd", max_grad_norm=0.05),
    ]
    _check(run_distributed(run_cases, world, cases, timeout=240), cases, world)
