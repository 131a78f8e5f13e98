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
    for bad in (0, -1, True, 2.0):  # refused like PipelineConfig's, before any process group exists
        with pytest.raises(ValueError, match=rf"num_microbatches must be a positive int, got {bad!r}"):
            HybridParallelPlugin(pp_size=2, num_microbatches=bad)
    assert HybridParallelPlugin(pp_size=2).num_microbatches == 2  # None: one per stage


class _Masked(torch.nn.Linear):
    def __init__(self, n):
        super().__init__(n, n)
        self.register_buffer("mask", (torch.arange(n * n).reshape(n, n) % 3 != 0).float())

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.mask, self.bias)


class _Residual(torch.nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


class _UserNet(torch.nn.Module):
    """A model this repository never saw: its own names, a masked Linear, a weight_norm Linear, and a
    gain registered after the blocks that only its own output step reads."""

    def __init__(self, v=16, h=8):
        super().__init__()
        self.stem = torch.nn.Embedding(v, h)
        self.layers = torch.nn.ModuleList(
            _Residual(_Masked(h), torch.nn.Tanh(), torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(h, h)))
            for _ in range(4)
        )
        self.readout = torch.nn.Linear(h, v)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, v))

    def forward(self, idx):
        x = self.stem(idx)
        for layer in self.layers:
            x = layer(x)
        return self.readout(x) * self.gain


def _user_losses(kwargs):
    from colossalai import Booster

    def crit(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    torch.manual_seed(0)
    model = _UserNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kwargs is not None:
        booster = Booster(plugin=HybridParallelPlugin(**kwargs))
        model, opt, *_ = booster.boost(model, opt, crit)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 16, (8, 4), generator=g), torch.randint(0, 16, (8, 4), generator=g)
    losses = []
    for _ in range(3):
        if kwargs is None:
            loss = crit(model(x), y)
            loss.backward()
        else:
            loss = booster.execute_pipeline((x, y), model, crit, opt)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pipeline_keeps_a_users_own_modules(schedule):
    """Issue 30: the masked and weight_norm Linear keep their forward under zero-bubble, and the late
    ``gain`` lands on the last stage and is used as the model's forward uses it (3 AdamW steps)."""
    ref = _user_losses(None)
    kwargs = dict(tp_size=1, pp_size=2, num_microbatches=2, pp_schedule=schedule)
    for got in run_distributed(_user_losses, 2, kwargs, timeout=180):
        assert got == pytest.approx(ref, rel=1e-5), (got, ref)
