"""Booster + HybridParallelPlugin(pp_size=...) against plain single-process PyTorch: pipeline
alone, pipeline x data parallel (DDP-style average and ZeRO-1), pipeline x tensor parallel; the
global gradient norm over pp x tp; checkpoints across pp layouts.

Tolerance: fp32, 1e-5 relative per-step loss (the pipeline sums micro-batch gradients in
``.grad`` rather than inside one batched product; reduction order only).
The tiny GPT ties its input and output embeddings, so every pipeline here also exercises the tied
weight held by the first and last stage.
"""

import pytest
import torch
from colossalai_harness import (
    GLOBAL_BATCH,
    boosted_losses,
    boosted_setup,
    criterion,
    dataset,
    make_model_and_optim,
    reference_losses,
    resume_and_train,
    train_and_save,
)

from colossal.comm.testing import run_distributed
from colossalai import HybridParallelPlugin
from colossalai.data import ResumableDistributedSampler

STEPS = 3
LAYOUTS = [
    (2, dict(tp_size=1, pp_size=2, num_microbatches=2)),
    (2, dict(tp_size=1, pp_size=2, num_microbatches=4, pp_schedule="zero_bubble")),
    (4, dict(tp_size=1, pp_size=2, num_microbatches=2, pp_schedule="gpipe")),  # dp2 x pp2
    (4, dict(tp_size=2, pp_size=2, num_microbatches=2)),  # pp2 x tp2
    (4, dict(tp_size=1, pp_size=2, num_microbatches=2, zero_stage=1)),  # dp2 x pp2, ZeRO-1
    (8, dict(tp_size=2, pp_size=2, num_microbatches=2)),  # pp2 x dp2 x tp2
    (4, dict(tp_size=1, sp_size=2, pp_size=2, num_microbatches=2)),  # pp2 x sp2 (ring)
    (4, dict(tp_size=1, sp_size=2, sp_kind="all_to_all", pp_size=2, num_microbatches=4, pp_schedule="interleaved")),
    (4, dict(tp_size=2, tp_mode="2.5d", tp_depth=2, pp_size=2, num_microbatches=2)),  # pp2 x 2.5D (q=1, d=2)
    (8, dict(tp_size=4, tp_mode="2d", pp_size=2, num_microbatches=2)),  # pp2 x 2D (2 x 2 grid)
]
IDS = [
    "pp2-1f1b", "pp2-zb", "dp2xpp2-gpipe", "pp2xtp2", "dp2xpp2-zero1", "pp2xdp2xtp2",
    "pp2xsp2", "pp2xsp2-a2a-interleaved", "pp2xtp2-2.5d", "pp2xtp4-2d",
]  # fmt: skip


def _losses(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    return boosted_losses(booster, model, optim, loader, STEPS)


@pytest.mark.parametrize("world,kwargs", LAYOUTS, ids=IDS)
def test_pipeline_matches_plain_pytorch(world, kwargs):
    got = run_distributed(_losses, world, kwargs, timeout=180)
    ref = torch.tensor(reference_losses(STEPS))
    for rank_losses in got:
        torch.testing.assert_close(torch.tensor(rank_losses), ref, rtol=1e-5, atol=0)


def _clip(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    x, y = next(iter(loader))
    booster.execute_pipeline((x, y), model, criterion, optim)
    before = booster.clip_grad_norm(optim, 1e-3).item()
    after = booster.clip_grad_norm(optim, 1e9).item()
    return before, after


def test_pipeline_clips_by_the_global_norm():
    """pp x tp: every stage's gradients count, tp-replicated ones and the tied embedding once."""
    torch.manual_seed(0)
    model, _ = make_model_and_optim()
    sampler = ResumableDistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    x, y = next(iter(torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)))
    criterion(model(x), y).backward()
    dense = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for before, after in run_distributed(_clip, 4, dict(tp_size=2, pp_size=2, num_microbatches=2), timeout=180):
        assert before == pytest.approx(dense, rel=1e-5)
        assert after == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize(
    "save,load",
    [(dict(tp_size=2, pp_size=2, num_microbatches=2), {}), ({}, dict(tp_size=1, pp_size=2, num_microbatches=2))],
    ids=["pp2xtp2-to-ddp", "ddp-to-pp2"],
)
def test_pipeline_resume_across_layouts(tmp_path, save, load):
    """Saved under the original names by each stage; resumes with another layout at the same loss."""
    run_distributed(train_and_save, 4, save, str(tmp_path), timeout=240)
    got = run_distributed(resume_and_train, 4, load, str(tmp_path), timeout=240)
    ref = torch.tensor(reference_losses(4, start=2))
    for rank_losses in got:
        torch.testing.assert_close(torch.tensor(rank_losses), ref, rtol=1e-5, atol=0)


def _fp16(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs), precision="fp16")
    losses = boosted_losses(booster, model, optim, loader, STEPS)
    x, y = next(iter(loader))  # then an overflow on one pipeline stage only
    booster.execute_pipeline((x, y), model, criterion, optim)
    param = next(iter(booster.plugin._pipe.parameters()))
    if torch.distributed.get_rank() == 1:
        param.grad.view(-1)[0] = float("inf")
    before, scale = param.detach().clone(), optim.scaler.scale
    optim.step()
    skipped_everywhere = optim.last_step_skipped and torch.equal(param.detach(), before)
    return losses, scale, optim.scaler.scale, skipped_everywhere


def test_pipeline_fp16_tracks_fp32_and_skips_overflow_on_every_rank():
    """fp16 autocast with the loss scaled inside the pipeline: losses within 3e-2 of fp32 (as for
    DDP); an inf on one stage skips the step on every rank, which keep one scale."""
    ref = torch.tensor(reference_losses(STEPS))
    results = run_distributed(_fp16, 2, dict(tp_size=1, pp_size=2, num_microbatches=2), timeout=180)
    for losses, scale, after, skipped in results:
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=3e-2, atol=0)
        assert scale > 1.0 and after <= scale and skipped, (
            scale,
            after,
            skipped,
        )  # (hysteresis may delay the back-off)
    assert len({r[2] for r in results}) == 1


def _odd_sequence(kwargs):
    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(**kwargs))
    x, y = next(iter(loader))
    try:
        booster.execute_pipeline((x[:, :-1], y[:, :-1]), model, criterion, optim)
    except ValueError as e:
        return str(e)
    return None


def test_pipeline_x_sequence_refuses_an_indivisible_sequence_on_every_rank():
    """A sequence length not divisible by sp raises ValueError on every rank, before any transfer."""
    for msg in run_distributed(_odd_sequence, 4, dict(tp_size=1, sp_size=2, pp_size=2, num_microbatches=2)):
        assert msg is not None and "divisible by sp_size=2" in msg and "31" in msg


def test_pipeline_refuses_bad_layouts():
    with pytest.raises(ValueError, match="pp_schedule must be one of"):
        HybridParallelPlugin(pp_size=2, pp_schedule="dualpipe")
