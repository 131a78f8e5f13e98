"""``OptimizerWrapper``: a wrapper is a ``torch.optim.Optimizer`` for torch's schedulers and hooks.

Reference: the wrapped optimizer driven by the same schedulers directly (exact: the same ops)."""

import pytest
import torch
from torch import nn

from colossal.optim import OptimizerWrapper


class Halving(OptimizerWrapper):
    """A minimal wrapper: halves the gradients, then steps the wrapped rule."""

    def __init__(self, optimizer):
        self._wrap(optimizer)
        self.inner = optimizer

    def step(self, closure=None):
        for g in self.inner.param_groups:
            for p in g["params"]:
                p.grad.mul_(0.5)
        return self.inner.step()

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)


def _run(wrap: bool):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    inner = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 1e-3}], lr=1e-2)
    opt = Halving(inner) if wrap else inner
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 1e-3], total_steps=5),
        torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9),
    ]
    lrs = []
    for _ in range(4):
        loss = model(torch.ones(2, 4)).square().sum()
        (loss * (1.0 if wrap else 0.5)).backward()  # the wrapper halves the gradient
        opt.step()
        opt.zero_grad()
        for s in scheds:
            s.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs, [p.detach().clone() for p in model.parameters()], opt


def test_schedulers_drive_the_wrapped_rule_as_they_drive_the_rule_itself():
    lrs, params, opt = _run(wrap=True)
    ref_lrs, ref_params, ref = _run(wrap=False)
    assert lrs == ref_lrs
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.param_groups is opt.inner.param_groups and opt.defaults is opt.inner.defaults
    assert opt.state is opt.inner.state


def test_step_hooks_run_around_the_wrappers_step():
    opt = Halving(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    for p in opt.inner.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert seen == ["pre", "post"]


def test_bad_use_is_refused_with_the_reason():
    with pytest.raises(TypeError, match="torch.optim.Optimizer, got Linear"):
        Halving(nn.Linear(2, 2))
    opt = Halving(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="cannot add a param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
