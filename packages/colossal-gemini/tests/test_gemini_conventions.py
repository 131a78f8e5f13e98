"""Conventions GeminiOptimizer shares with ZeroOptimizer (see the GeminiOptimizer docstring):
``max_grad_norm=None`` disables clipping and a non-positive value is an error; an inf/NaN gradient
skips the step in fp32 too (it used to be applied unless ``check_overflow=True``); ``grad_norm()``
and ``last_grad_norm`` give torch's ``clip_grad_norm_`` total norm. Reference: plain PyTorch, fp32."""

import copy

import pytest
import torch
from torch import nn

from colossal.gemini import GeminiDDP, GeminiOptimizer


def _pair(**kw):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(ref)
    gem = GeminiDDP(model, device_memory_budget=1 << 24, chunk_size=64)
    return ref, gem, GeminiOptimizer(torch.optim.SGD(gem.parameters(), lr=0.1), gem, **kw)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_non_positive_max_grad_norm_is_an_error(bad):
    with pytest.raises(ValueError, match="max_grad_norm must be positive or None"):
        _pair(max_grad_norm=bad)


def test_inf_gradient_skips_the_step_in_fp32():
    _, gem, opt = _pair()
    before = {k: v.clone() for k, v in gem.state_dict().items()}
    x = torch.randn(2, 4)
    opt.backward(gem(x).sum() * float("inf"))
    assert opt.step() is False and opt.skipped_steps == 1
    after = gem.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_grad_norm_and_last_grad_norm_match_torch():
    ref, gem, opt = _pair(max_grad_norm=0.1)
    x = torch.randn(5, 4)
    ref(x).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    opt.backward(gem(x).pow(2).sum())
    torch.testing.assert_close(opt.grad_norm(), want, rtol=1e-5, atol=0)
    assert opt.step()
    torch.testing.assert_close(opt.last_grad_norm, want, rtol=1e-5, atol=0)


def test_a_rule_that_needs_whole_parameters_is_refused():
    """Issue 31 item 5: Adafactor ran on Gemini's slices and drifted from torch; it is refused, naming
    what is supported."""
    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match=r"GeminiOptimizer cannot run torch.optim.Adafactor.*AdamW"):
        GeminiOptimizer(torch.optim.Adafactor(model.parameters(), lr=0.1), None)


def test_group_and_process_group_are_one_knob():
    """#31 item 6: ``group=`` as everywhere else, ``process_group=`` (torch FSDP's spelling) kept.
    (Stand-ins for two groups: the config only routes them, and no process group is initialised here.)"""
    from colossal.gemini import GeminiConfig

    world, other = object(), object()
    assert GeminiConfig(device_memory_budget=1, group=world).process_group is world
    assert GeminiConfig(device_memory_budget=1, process_group=world).group is world
    assert GeminiConfig(device_memory_budget=1, group=world, process_group=world).group is world
    with pytest.raises(ValueError, match="name the same knob"):
        GeminiConfig(device_memory_budget=1, group=world, process_group=other)
