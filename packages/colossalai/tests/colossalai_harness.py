"""Shared pieces of the colossalai tests: a tiny GPT run with plain PyTorch (the reference) and
the same run through a Booster, on any plugin and world size.

Both runs see the same global batches (``ResumableDistributedSampler`` note), start from the same
seeded weights and use AdamW, so per-step mean losses must agree up to fp32 reduction order.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossalai import Booster
from colossalai.data import ResumableDistributedSampler, TokenWindows, load_corpus
from colossalai.models import build_gpt

GLOBAL_BATCH = 8
SEQ = 32
LR = 3e-3


@functools.cache
def dataset() -> TokenWindows:
    return TokenWindows(load_corpus(max_bytes=60_000), SEQ)


def criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def make_model_and_optim(lazy: bool = False):
    model = build_gpt("tiny", seed=0, lazy=lazy, block_size=SEQ)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, optim


def reference_losses(steps: int, start: int = 0) -> list[float]:
    """Plain single-process PyTorch: the losses of steps ``start..steps-1``."""
    torch.manual_seed(0)
    model, optim = make_model_and_optim()
    sampler = ResumableDistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = criterion(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses[start:]


def mean_over_dp(loss: torch.Tensor, booster: Booster) -> float:
    value = loss.detach().float().clone()
    if dist.is_initialized() and booster.plugin.dp_size() > 1:
        dist.all_reduce(value, group=getattr(booster.plugin, "dp_group", None))
        value /= booster.plugin.dp_size()
    return value.item()


def boosted_setup(plugin, precision=None, lazy: bool = False):
    torch.manual_seed(0)
    booster = Booster(plugin=plugin, mixed_precision=precision)
    model, optim = make_model_and_optim(lazy=lazy)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
    model, optim, _, loader, _ = booster.boost(model, optim, criterion, loader)
    return booster, model, optim, loader


def boosted_losses(booster, model, optim, loader, steps: int, start: int = 0) -> list[float]:
    losses = []
    device = booster.plugin.device
    for step, (x, y) in enumerate(loader, start=start):
        if step == steps:
            break
        loss = booster.execute_pipeline((x.to(device), y.to(device)), model, criterion, optim)  # any plugin, pp too
        optim.step()
        optim.zero_grad()
        losses.append(mean_over_dp(loss, booster))
    return losses


# -- save after SAVE_AT steps with one layout, resume with another up to TOTAL (rank functions) --
SAVE_AT, TOTAL = 2, 4


def hybrid_or_ddp(kwargs: dict):
    """``HybridParallelPlugin(**kwargs)``, or plain DDP for empty ``kwargs``."""
    from colossalai import HybridParallelPlugin, TorchDDPPlugin

    return HybridParallelPlugin(**kwargs) if kwargs else TorchDDPPlugin()


def train_and_save(kwargs: dict, root: str) -> list[float]:
    """Train SAVE_AT steps with ``hybrid_or_ddp(kwargs)`` and save a run checkpoint under ``root``."""
    from colossalai import RunState

    booster, model, optim, loader = boosted_setup(hybrid_or_ddp(kwargs))
    losses = boosted_losses(booster, model, optim, loader, SAVE_AT)
    booster.save_run(root, model, optim, state=RunState(step=SAVE_AT, consumed_samples=SAVE_AT * GLOBAL_BATCH))
    return losses


def resume_and_train(kwargs: dict, root: str) -> list[float]:
    """Load the run under ``root`` into ``hybrid_or_ddp(kwargs)`` and train up to TOTAL steps."""
    booster, model, optim, loader = boosted_setup(hybrid_or_ddp(kwargs))
    state = booster.load_run(root, model, optim, dataloader=loader)
    return boosted_losses(booster, model, optim, loader, TOTAL, start=state.step)
