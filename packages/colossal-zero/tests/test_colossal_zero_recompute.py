"""Stage 3 under activation checkpointing: the recomputation in backward gathers nothing extra;
and the prefetch depth (``prefetch=k``: the next k units gathered ahead) changes neither the
losses nor the bytes gathered, only how many units are in flight at once.

A unit's forward runs again inside backward just before its own backward ([Note: recomputation in
backward] in ``colossal.zero.stage3``); it must neither prefetch the next unit (whose backward ran
already) nor free itself before its backward. Same losses and the same all-gather bytes per step
as without checkpointing, on 2 ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from colossal_zero_testutil import loss_of, make_model, make_optimizer, rank_batch
from torch.utils.checkpoint import checkpoint

from colossal.comm import CommCounter
from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer
from colossal.zero._flat_param import ShardedState


def _checkpointed(model):
    """Each block called through ``checkpoint`` as a module (its hooks run again in the recomputation,
    as ``colossalai.models.GPT.set_activation_checkpointing`` and Hugging Face models do it)."""

    def forward(idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = model.drop(model.wte(idx) + model.wpe(pos))
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return model.lm_head(model.ln_f(x))

    model.forward = forward
    return model


def _run(recompute: bool, prefetch: int = 1, n_layer: int = 3):
    model = make_model(n_layer=n_layer)
    if recompute:
        _checkpointed(model)
    zero = ZeroOptimizer(make_optimizer(model), model, stage=3, prefetch=prefetch)
    ahead = []  # per block forward: the other non-root units gathered or in flight (prefetched)

    def count(module, args):
        units = [u for u in zero.units[1:] if u.module is not module]
        ahead.append(sum(any(f.state is not ShardedState.SHARDED for f in u.flats) for u in units))

    for block in model.blocks:
        block.register_forward_pre_hook(count)
    losses, gathered = [], []
    for step in range(3):
        x, y = rank_batch(step, 0, 1, dist.get_world_size(), dist.get_rank())
        with CommCounter() as counter:
            loss = loss_of(model, x, y)
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
        losses.append(loss.item())
        gathered.append(counter.by_tag.get("zero.all_gather_params", 0))
    return losses, gathered, ahead


def _both():
    return _run(False), _run(True), [_run(False, prefetch=k, n_layer=4) for k in (0, 1, 2)]


def test_recomputation_gathers_each_unit_once_and_matches():
    (plain_losses, plain_gathered, _), (ac_losses, ac_gathered, _), depths = run_distributed(_both, 2, timeout=120)[0]
    assert ac_gathered == plain_gathered  # before the fix: a third more (the next unit, and the unit again)
    torch.testing.assert_close(torch.tensor(ac_losses), torch.tensor(plain_losses), rtol=1e-6, atol=0)
    (losses0, gathered0, _), *_ = depths
    for k, (losses, gathered, ahead) in enumerate(depths):
        assert gathered == gathered0, k  # each unit gathered once for forward and once for backward
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses0), rtol=0, atol=0)
        # the forward of the first step records the order: prefetching starts from the second step;
        # block i sees min(k, 4 - 1 - i) later blocks in flight (nothing earlier: freed after forward)
        assert ahead[4:8] == [min(k, 3 - i) for i in range(4)], (k, ahead)
