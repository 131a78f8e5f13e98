"""Activation checkpointing (``torch.utils.checkpoint``) inside a GeminiDDP model, see
``[Note: recomputation]`` in ``ddp.py``: the recomputed forwards run inside backward.

Reference: the same model and batches in plain PyTorch (same checkpointing), fp32; tolerance 1e-5
relative (same ops; gradients copied through chunk buffers, AdamW element-wise on fp32 masters).
The attention key bias is excluded on 2 ranks (its true gradient is exactly zero: see test_gemini_dist).
"""

import copy
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from colossal.comm.testing import run_distributed

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from colossal.gemini import GeminiDDP, GeminiOptimizer  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, random_batches, train_reference  # noqa: E402


class _CkptGPT(GPT):
    reentrant = False

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.lm_head(self.ln_f(x))


def _model(reentrant):
    torch.manual_seed(0)
    model = _CkptGPT(GPTConfig(init="torch"))
    model.reentrant = reentrant
    return model


def _reference(batches, reentrant):
    model = _model(reentrant)
    init = copy.deepcopy(model.state_dict())
    final, _ = train_reference(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)
    return init, final


def _gemini(batches, init, reentrant, **kw):
    model = _model(reentrant)
    model.load_state_dict(init)
    gem = GeminiDDP(model, chunk_size=8192, **kw)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for x, y in batches:
        b = x.shape[0] // world
        opt.backward(lm_loss(gem(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b]))
        opt.step()
        assert all(c.pins == 0 and not c.in_use for c in gem.manager.chunks)  # nothing left pinned
    return gem.state_dict(), gem.stats_history


def _check(got, ref, skip_key_bias):
    for k, v in ref.items():
        if not (skip_key_bias and k.endswith("k_proj.bias")):
            assert_close(got[k], v)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("budget", [10_000_000, 200_000], ids=["roomy", "tight"])
def test_checkpointed_blocks_match_torch_on_one_rank(reentrant, budget):
    batches = random_batches(4, batch=1, seq=8)
    init, ref = _reference(batches, reentrant)
    got, stats = _gemini(batches, init, reentrant, device_memory_budget=budget, prefetch=0)
    _check(got, ref, skip_key_bias=False)
    assert all(s.peak_device_bytes <= budget for s in stats)
    if budget < 1_000_000:
        assert stats[-1].bytes_moved > 0  # chunks really were evicted and fetched


def _rank(batches, init, budget, prefetch):
    return _gemini(batches, init, False, device_memory_budget=budget, prefetch=prefetch)[0]


# (batch, seq, budget): the second needs the recomputations' chunks in the placement and prefetch
# plan (OpRecord.recompute_chunk_ids): without them prefetching ran out of budget mid-training
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("shape", [(2, 8, 300_000), (4, 16, 600_000)], ids=["b2s8", "b4s16"])
def test_non_reentrant_checkpointing_matches_torch_on_two_ranks_under_budget(shape, prefetch):
    batch, seq, budget = shape
    batches = random_batches(3, batch=batch, seq=seq)
    init, ref = _reference(batches, False)
    for got in run_distributed(_rank, 2, batches, init, budget, prefetch, timeout=120):
        _check(got, ref, skip_key_bias=True)
