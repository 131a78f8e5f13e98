"""Lamb against a float64 re-implementation of the paper's Algorithm 2, written here."""

import copy
import math

import pytest
import torch
from _colossal_optim_helpers import make_grads, make_params

from colossal.optim import Lamb, large_batch_param_groups

STEPS = 5


def lamb_reference(ws, grads_by_step, *, lr, betas, eps, wd, bias_correction, adam, trust, lrs=None):
    """Algorithm 2 of You et al. (2020), per tensor, float64, phi = identity."""
    b1, b2 = betas
    ws = [w.clone() for w in ws]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_by_step, start=1):
        lr_t = lrs[t - 1] if lrs else lr
        for i, (w, g) in enumerate(zip(ws, grads)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1**t) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2**t) if bias_correction else vs[i]
            u = m_hat / (v_hat.sqrt() + eps) + wd[i] * w
            w_norm, u_norm = w.norm().item(), u.norm().item()
            ratio = w_norm / u_norm if (w_norm > 0 and u_norm > 0 and trust[i] and not adam) else 1.0
            ws[i] = w - lr_t * ratio * u
    return ws


def run_lamb(ws, grads_by_step, groups_kw, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    groups = [{"params": [params[i] for i in idx], **extra} for idx, extra in groups_kw]
    opt = Lamb(groups, **kw)
    for grads in grads_by_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam", [False, True])
def test_matches_paper_float64(wd, bias_correction, adam):
    ws = make_params(0)
    grads = [make_grads(0, t) for t in range(STEPS)]
    # group 0: decayed weights with trust ratio; group 1: a "bias" excluded from both
    groups_kw = [([0, 1, 2], {}), ([3], {"weight_decay": 0.0, "trust_ratio": False})]
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)
    params, _ = run_lamb(ws, grads, groups_kw, weight_decay=wd, bias_correction=bias_correction, adam=adam, **kw)
    ref = lamb_reference(
        ws, grads, wd=[wd, wd, wd, 0.0], bias_correction=bias_correction, adam=adam,
        trust=[True, True, True, False], **kw,
    )  # fmt: skip
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)


def test_zero_norm_trust_ratio_is_one():
    w = [torch.zeros(4, dtype=torch.float64)]
    g = [[torch.ones(4, dtype=torch.float64)]]
    params, _ = run_lamb(w, g, [([0], {})], lr=0.1)
    # ||w|| = 0 -> ratio 1 -> plain Adam step of size lr in every coordinate (m_hat/sqrt(v_hat) = 1)
    torch.testing.assert_close(params[0].detach(), torch.full((4,), -0.1, dtype=torch.float64), rtol=1e-5, atol=0)


def test_state_dict_round_trip_mid_training_and_scheduler():
    ws = make_params(1, torch.float32)
    grads = [make_grads(1, t, torch.float32) for t in range(6)]
    a = [torch.nn.Parameter(w.clone()) for w in ws]
    opt_a = Lamb(a, lr=0.01, weight_decay=0.01)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    for t in range(3):
        for p, g in zip(a, grads[t]):
            p.grad = g.clone()
        opt_a.step()
        sched_a.step()
    sd, sched_sd = copy.deepcopy(opt_a.state_dict()), copy.deepcopy(sched_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = Lamb(b, lr=123.0)
    opt_b.load_state_dict(sd)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    sched_b.load_state_dict(sched_sd)
    for t in range(3, 6):
        for pa, pb, g in zip(a, b, grads[t]):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step(), opt_b.step()
        sched_a.step(), sched_b.step()
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == 0.01 * 0.5**3
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_lr_schedule_matches_reference():
    ws = make_params(2)
    grads = [make_grads(2, t) for t in range(4)]
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = Lamb(params, lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))
    for g_step in grads:
        for p, g in zip(params, g_step):
            p.grad = g.clone()
        opt.step()
        sched.step()
    ref = lamb_reference(
        ws, grads, lr=None, lrs=[0.1 / (t + 1) for t in range(4)], betas=(0.9, 0.999), eps=1e-6,
        wd=[0.01] * 4, bias_correction=True, adam=False, trust=[True] * 4,
    )  # fmt: skip
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)


def test_zero_grad_skips_params_without_grad_and_bf16_runs():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    groups = large_batch_param_groups(model, 0.01)
    assert [len(g["params"]) for g in groups] == [1, 3] and groups[1]["trust_ratio"] is False
    opt = Lamb(groups, lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    p16 = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    p16.grad = torch.randn(8, dtype=torch.bfloat16)
    Lamb([p16], lr=0.01).step()
    assert p16.dtype == torch.bfloat16 and torch.isfinite(p16).all()


def test_refuses_sparse_and_complex_and_bad_args():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        Lamb([p]).step()
    c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    c.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match="real"):
        Lamb([c]).step()
    with pytest.raises(ValueError, match="betas"):
        Lamb([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        Lamb([p], lr=-1.0)
    with pytest.raises(TypeError, match="norm_reducer"):
        Lamb([p], norm_reducer=3)
    assert math.isfinite(Lamb([p]).defaults["eps"])
