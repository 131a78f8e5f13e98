"""Saving and loading are collectives: a call on some ranks only (``if rank == 0: save``) raises a
CheckpointError naming the missing ranks within the Booster's ``checkpoint_timeout`` instead of
hanging, on the rank that called; the other rank goes on and ends."""

import time

import pytest
import torch
from torch import nn

from colossal.comm.testing import run_distributed
from colossalai import Booster
from colossalai.booster.registry import make_plugin
from colossalai.checkpoint import CheckpointError

TIMEOUT = 2.0


def _setup(plugin: str):
    booster = Booster(plugin=make_plugin(plugin), checkpoint_timeout=TIMEOUT)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optim, *_ = booster.boost(model, optim)
    return booster, model, optim


def only_rank0_saves(plugin: str, root: str):
    import torch.distributed as dist

    booster, model, optim = _setup(plugin)
    if dist.get_rank() != 0:
        return None  # the mistake: this rank skips the save and goes on
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        booster.save_model(model, root)
    return time.perf_counter() - start, str(err.value)


@pytest.mark.parametrize("plugin", ["ddp", "zero"])
def test_save_on_one_rank_raises_naming_the_others(tmp_path, plugin):
    start = time.perf_counter()
    results = run_distributed(only_rank0_saves, 2, plugin, str(tmp_path), timeout=120)
    assert results[1] is None  # the other rank ended too
    seconds, message = results[0]
    assert TIMEOUT <= seconds < TIMEOUT + 5, seconds
    assert "ranks [1] did not call it" in message and "Booster.save_model" in message, message
    assert "if rank == 0" in message
    print(f"detected in {seconds:.2f} s (timeout {TIMEOUT} s), whole run {time.perf_counter() - start:.1f} s")


def save_on_one_load_on_other(root: str):
    import torch.distributed as dist

    booster, model, optim = _setup("ddp")
    booster.save_model(model, root)  # every rank: fine
    with pytest.raises(CheckpointError, match="called different operations") as err:
        if dist.get_rank() == 0:
            booster.save_model(model, root)
        else:
            booster.load_model(model, f"{root}/model")
    return str(err.value)


def test_ranks_calling_different_operations_raise(tmp_path):
    messages = run_distributed(save_on_one_load_on_other, 2, str(tmp_path), timeout=120)
    assert all("Booster.save_model" in m and "Booster.load_model" in m for m in messages), messages


def test_checkpoint_timeout_must_be_positive():
    with pytest.raises(ValueError, match="checkpoint_timeout must be a positive"):
        Booster(plugin=make_plugin("ddp"), checkpoint_timeout=0)
