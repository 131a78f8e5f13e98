"""A meta-device model boosted with pp_size > 1 is never materialised whole: each rank allocates and
initialises only its own stages, with the values of the dense build from the same seed
(``[Note: meta construction under pp]``), and then trains exactly like plain PyTorch.

Peak bytes are those the CPU allocator hands out during ``booster.boost`` (torch profiler memory
events), so a rank that built the whole model, even for a moment, fails the bound.
Tolerance: fp32, 1e-5 relative per-step loss (micro-batch gradient sums, reduction order only).
"""

import torch
from colossalai_harness import GLOBAL_BATCH, LR, SEQ, criterion, dataset
from torch.profiler import ProfilerActivity, profile

from colossal.comm.testing import run_distributed
from colossalai import Booster, HybridParallelPlugin
from colossalai.data import ResumableDistributedSampler
from colossalai.models import build_gpt

N_LAYER, STEPS = 6, 3


def _meta_gpt():
    return build_gpt("tiny", lazy=True, block_size=SEQ, n_layer=N_LAYER, n_embd=64)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _peak_allocated(fn):
    """(result of ``fn()``, peak bytes the CPU allocator held above its level at the start)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return out, peak


def _dense_losses(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = _meta_gpt().materialize("cpu")  # what the Booster does with a meta model without pp
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sampler = ResumableDistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)
    losses = []
    for _, (x, y) in zip(range(steps), loader, strict=False):
        loss = criterion(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _boost_meta(kwargs):
    booster = Booster(plugin=HybridParallelPlugin(**kwargs))
    model = _meta_gpt()
    whole = _bytes(model.parameters())
    largest = max(_bytes([p]) for p in model.parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // booster.plugin.dp_size(), seed=0)
    torch.manual_seed(0)
    (model, optim, _, loader, _), peak = _peak_allocated(lambda: booster.boost(model, optim, criterion, loader))
    stages = _bytes(p for p in booster.plugin._pipe.parameters())  # this rank's (tp-split) parameters
    dense_stage = sum(booster.plugin._dense_shapes[n].numel() * 4 for n, _ in booster.plugin._pipe.named_parameters())
    losses = []
    for _, (x, y) in zip(range(STEPS), loader, strict=False):
        losses.append(booster.execute_pipeline((x, y), model, criterion, optim).item())
        optim.step()
        optim.zero_grad()
    return losses, peak, stages, dense_stage, whole, largest


def _check(world, kwargs, below_whole: float):
    ref = torch.tensor(_dense_losses(STEPS))
    for losses, peak, stages, dense_stage, whole, largest in run_distributed(_boost_meta, world, kwargs, timeout=180):
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-5, atol=0)
        # the stage's dense tensors (before a tp split), its split copies, one scratch tensor, 16 KiB of the rest
        assert peak <= dense_stage + stages + largest + 16384, (peak, dense_stage, stages, largest, whole)
        assert peak < below_whole * whole, (peak, whole)


def test_meta_gpt_pp2_materialises_only_its_stages_and_matches_dense():
    _check(2, dict(tp_size=1, pp_size=2, num_microbatches=2), 0.7)


def test_meta_gpt_pp2_tp2_materialises_only_its_stages_and_matches_dense():
    _check(4, dict(tp_size=2, pp_size=2, num_microbatches=2), 0.9)


def test_meta_gpt_pp2_sp2_materialises_only_its_stages_and_matches_dense():
    _check(4, dict(tp_size=1, sp_size=2, pp_size=2, num_microbatches=2), 0.7)
