"""GeminiOptimizer: gradient clipping, gradient accumulation, overflow skip and HybridAdam, against plain torch."""

import copy
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from colossal.gemini import GeminiDDP, GeminiOptimizer  # noqa: E402
from colossal.optim import DynamicLossScaler, HybridAdam  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, random_batches  # noqa: E402

BUDGET = 200_000


def _pair(optim_cls=torch.optim.AdamW, optim_kwargs=None, **gemini_opt):
    torch.manual_seed(0)
    ref = GPT(GPTConfig(init="torch"))
    gem = GeminiDDP(copy.deepcopy(ref), device_memory_budget=BUDGET, chunk_size=8192)
    opt = GeminiOptimizer(optim_cls(gem.parameters(), lr=1e-2, **(optim_kwargs or {})), gem, **gemini_opt)
    return ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), gem, opt


def _assert_same(ref, gem):
    state = gem.state_dict()
    for k, v in ref.state_dict().items():
        if k.endswith("k_proj.bias"):  # zero true gradient, pure rounding noise (see test_gemini_dist.py)
            continue
        assert_close(state[k], v)


def test_clipping_and_accumulation_match_torch():
    batches = random_batches(4, batch=1, seq=8)
    ref, ropt, gem, opt = _pair(max_grad_norm=0.5)
    for i in range(0, 4, 2):  # two micro-batches per step
        for x, y in batches[i : i + 2]:
            (lm_loss(ref(x), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
        ropt.zero_grad()
    for i in range(0, 4, 2):  # (not interleaved: the warm-up tracer would count the reference's activations)
        for x, y in batches[i : i + 2]:
            opt.backward(lm_loss(gem(x), y) / 2)
        opt.step()
    _assert_same(ref, gem)


def test_overflow_skips_the_step_and_backs_off_the_scale():
    x, y = random_batches(1, batch=1, seq=8)[0]
    _, _, gem, opt = _pair(loss_scaler=DynamicLossScaler(initial_scale=2.0**16, hysteresis=1))
    before = gem.state_dict()
    opt.backward(lm_loss(gem(x), y) * float("inf"))
    assert opt.step() is False and opt.skipped_steps == 1
    assert opt.scaler.scale == 2.0**15
    after = gem.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k])
    opt.backward(lm_loss(gem(x), y))
    assert opt.step() is True  # trains on after the skip (warm-up finishes on the first real step)
    assert gem.stats.policy == "auto"


def test_hybrid_adam_matches_torch_adamw():
    batches = random_batches(2, batch=1, seq=8)
    ref, ropt, gem, opt = _pair(optim_cls=HybridAdam, optim_kwargs=dict(weight_decay=0.01, flatten=False))
    for x, y in batches:
        lm_loss(ref(x), y).backward()
        ropt.step()
        ropt.zero_grad()
    for x, y in batches:
        opt.backward(lm_loss(gem(x), y))
        opt.step()
    _assert_same(ref, gem)


def test_rejects_foreign_optimizer():
    _, _, gem, _ = _pair()
    with pytest.raises(ValueError, match="flatten=False"):
        GeminiOptimizer(HybridAdam(gem.parameters(), lr=1e-2), gem)
    with pytest.raises(ValueError, match="not a parameter of the GeminiDDP model"):
        GeminiOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0), gem)
    with pytest.raises(TypeError, match="GeminiDDP"):
        GeminiOptimizer(torch.optim.SGD(gem.parameters(), lr=1.0), gem.module)
