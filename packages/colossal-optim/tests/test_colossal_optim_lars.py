"""Lars against a float64 re-implementation of the paper's Algorithm 1, written here."""

import copy

import pytest
import torch
from _colossal_optim_helpers import make_grads, make_params

from colossal.optim import Lars

STEPS = 5


def lars_reference(ws, grads_by_step, *, lrs, momentum, wd, eta, eps, trust, return_v=False):
    """Algorithm 1 of You et al. (2017): v = m v + lr * lambda * (g + wd w); w = w - v (v_0 = 0)."""
    ws = [w.clone() for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_by_step):
        for i, (w, g) in enumerate(zip(ws, grads)):
            w_norm, g_norm = w.norm().item(), g.norm().item()
            if trust[i] and w_norm > 0 and g_norm > 0:
                local = eta * w_norm / (g_norm + wd[i] * w_norm + eps)
            else:
                local = 1.0
            vs[i] = momentum * vs[i] + lrs[t] * local * (g + wd[i] * w)
            ws[i] = w - vs[i]
    return (ws, vs) if return_v else ws


@pytest.mark.parametrize("wd", [0.0, 5e-4])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_matches_paper_float64(wd, momentum):
    ws = make_params(3)
    grads = [make_grads(3, t) for t in range(STEPS)]
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0, "trust_ratio": False}]
    opt = Lars(groups, lr=2.0, momentum=momentum, weight_decay=wd, eta=0.01, eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))  # lr sits inside the momentum
    for g_step in grads:
        for p, g in zip(params, g_step):
            p.grad = g.clone()
        opt.step()
        sched.step()
    ref = lars_reference(
        ws, grads, lrs=[2.0 / (t + 1) for t in range(STEPS)], momentum=momentum, wd=[wd, wd, wd, 0.0], eta=0.01,
        eps=1e-9, trust=[True, True, True, False],
    )  # fmt: skip
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)


def test_fp32_small_scales_and_zero_lr_match_float64():
    # fp32 parameters, tiny lr * ratio (~1e-6) and an lr of 0 mid-training: the rescaled momentum
    # buffer of [Note: LARS through the fused SGD kernel] must stay exact to fp32 rounding.
    ws = [w.float().double() for w in make_params(5)]
    grads = [[g.float().double() for g in step] for step in (make_grads(5, t) for t in range(STEPS))]
    lrs = [0.01, 0.0, 0.02, 0.005, 0.01]
    params = [torch.nn.Parameter(w.float()) for w in ws]
    opt = Lars(params, lr=1.0, momentum=0.9, weight_decay=1e-4, eta=1e-3)
    for t, g_step in enumerate(grads):
        opt.param_groups[0]["lr"] = lrs[t]
        for p, g in zip(params, g_step):
            p.grad = g.float()
        opt.step()
    ref, ref_v = lars_reference(
        ws, grads, lrs=lrs, momentum=0.9, wd=[1e-4] * 4, eta=1e-3, eps=1e-8, trust=[True] * 4, return_v=True
    )
    for p, r, v in zip(params, ref, ref_v):
        st = opt.state[p]
        # the velocity v = scale * buffer carries the tiny scales: fp32-exact (1e-5 relative)
        torch.testing.assert_close(st["momentum_buffer"].double() * st["scale"], v, rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(p.double(), r, rtol=1e-6, atol=1e-6)


def test_zero_norms_use_ratio_one():
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    w.grad = torch.ones(3, dtype=torch.float64)
    v = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    v.grad = torch.zeros(3, dtype=torch.float64)
    Lars([w, v], lr=0.5, momentum=0.0).step()
    assert w.tolist() == [-0.5] * 3 and v.tolist() == [1.0] * 3


def test_state_dict_round_trip_mid_training():
    ws = make_params(4, torch.float32)
    grads = [make_grads(4, t, torch.float32) for t in range(6)]
    a = [torch.nn.Parameter(w.clone()) for w in ws]
    opt_a = Lars(a, lr=0.5, weight_decay=1e-4)
    for t in range(3):
        for p, g in zip(a, grads[t]):
            p.grad = g.clone()
        opt_a.step()
    sd = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = Lars(b, lr=9.0)
    opt_b.load_state_dict(sd)
    for t in range(3, 6):
        for pa, pb, g in zip(a, b, grads[t]):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step(), opt_b.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_refuses_sparse_complex_and_bad_args():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        Lars([p]).step()
    c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    c.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match="real"):
        Lars([c]).step()
    with pytest.raises(ValueError, match="momentum"):
        Lars([p], momentum=1.0)
    with pytest.raises(ValueError, match="eta"):
        Lars([p], eta=0.0)
