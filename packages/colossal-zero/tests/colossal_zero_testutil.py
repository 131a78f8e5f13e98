"""Shared pieces of the colossal-zero tests: data, the single-process reference, rank functions.
The model and the parity checks are colossal.testkit's (shared with the other suites)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from colossal.comm.testing import preload
from colossal.testkit import GPT, GPTConfig, lm_loss, max_rel_err, train_reference
from colossal.zero import ZeroOptimizer

# Import these once in the harness's forkserver (before the first run of the session) so that no
# rank pays for them; torch._dynamo and torch.optim are in the harness's default list already.
preload("torch.distributed.checkpoint", "colossal.optim", "colossal.zero")

__all__ = ["B", "T", "SIZES", "make_model", "make_optimizer", "global_batch", "loss_of", "reference"]
__all__ += ["rank_batch", "train_zero", "max_rel_err", "run_cases"]

B, T = 2, 8  # per-rank micro-batch, sequence length
SIZES = dict(vocab_size=64, block_size=16, n_embd=16, n_head=2)
"""This suite's GPT: smaller than the testkit's default (ZeRO's logic does not need width)."""


def make_model(seed: int = 0, **cfg) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SIZES, **cfg}))


def make_optimizer(model, kind: str = "adamw", lr: float = 1e-2):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if kind == "hybrid":
        from colossal.optim import HybridAdam

        return HybridAdam(groups, lr=lr)
    if kind == "lamb":
        from colossal.optim import Lamb

        return Lamb(groups, lr=lr)
    if kind == "lars":
        from colossal.optim import Lars

        return Lars(groups, lr=lr * 10, momentum=0.9)
    raise ValueError(kind)


def global_batch(step: int, rows: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (rows, T + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_of(model, x, y) -> torch.Tensor:
    """Next-token loss of ``model`` on ``(x, y)``."""
    return lm_loss(model(x), y)


def reference(steps: int, world: int, accum: int = 1, clip: float | None = None, kind: str = "adamw"):
    """Single-process training on the same global batches: (final state dict, losses)."""
    model = make_model()
    batches = [global_batch(step, world * B * accum) for step in range(steps)]
    return train_reference(model, make_optimizer(model, kind), batches, clip=clip)


def rank_batch(step: int, micro: int, accum: int, world: int, rank: int):
    """This rank's micro-batch ``micro`` of global step ``step`` (rows grouped by micro-batch)."""
    x, y = global_batch(step, world * B * accum)
    lo = (micro * world + rank) * B
    return x[lo : lo + B], y[lo : lo + B]


def train_zero(steps: int, accum: int = 1, kind: str = "adamw", use_no_sync: bool = False, **zero_kw):
    """Rank function: train with ZeroOptimizer; returns (full state dict, losses, zero stats)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model, kind), model, **zero_kw)
    if zero_kw.get("offload_optim_frac") and zero.config.param_dtype == torch.float32:
        trained = [f for f in zero.flats if f.master is not None]  # the last round(frac * n) are copies
        placed = [not f.master_aliased for f in trained]
        n_host = round(zero_kw["offload_optim_frac"] * len(trained))
        assert 0 < n_host < len(trained) and placed == [i >= len(trained) - n_host for i in range(len(trained))]
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(accum):
            x, y = rank_batch(step, micro, accum, world, rank)
            loss = loss_of(model, x, y) / accum
            if use_no_sync and micro < accum - 1:
                with zero.no_sync():
                    zero.backward(loss)
            else:
                zero.backward(loss)
            total += loss.detach()
        zero.step()
        zero.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return zero.full_model_state_dict(), losses


def run_cases(cases: list[dict]) -> list:
    """Rank function: several :func:`train_zero` runs in one process group (saves start-up)."""
    return [train_zero(**case) for case in cases]
