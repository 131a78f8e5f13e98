"""Train any model a few steps with plain PyTorch (the reference) and through a Booster, on the
same global batches and the same seeded weights, returning the per-step mean losses.

``build()`` makes the model (seeded by the caller's ``torch.manual_seed(0)``), ``batches`` is a list
of dicts of tensors whose first dimension is the global batch, ``loss_fn(model, batch)`` the loss.
Each data-parallel rank trains on its contiguous rows of every global batch, so the mean of the
ranks' losses is the reference loss up to fp32 reduction order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colossalai import Booster

LR = 1e-2


def dense_losses(build, batches: list[dict], loss_fn) -> list[float]:
    """Plain single-process PyTorch with AdamW."""
    torch.manual_seed(0)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _rows(batch: dict, rank: int, n: int, device) -> dict:
    out = {}
    for k, v in batch.items():
        b = v.shape[0] // n
        out[k] = v[rank * b : (rank + 1) * b].to(device)
    return out


def boosted_losses(plugin, build, batches: list[dict], loss_fn) -> list[float]:
    """The same run through ``Booster(plugin=plugin)``; losses averaged over the dp ranks."""
    torch.manual_seed(0)
    booster = Booster(plugin=plugin)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optim, *_ = booster.boost(model, optim)
    dp, rank = plugin.dp_size(), plugin.dp_rank()
    group = getattr(plugin, "dp_group", None)
    losses = []
    for batch in batches:
        loss = loss_fn(model, _rows(batch, rank, dp, plugin.device))
        booster.backward(loss, optim)
        optim.step()
        optim.zero_grad()
        value = loss.detach().float().clone()
        if dp > 1:
            dist.all_reduce(value, group=group)
            value /= dp
        losses.append(value.item())
    return losses


def errors_on_every_rank(fn) -> str:
    """Run ``fn()``, which must raise ``ValueError``; return its message (each rank raises alone,
    before any collective, or the run would hang and time out)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")
