"""CPUAdam / HybridAdam against torch.optim.Adam/AdamW (same kernel: equal to 1e-6 relative, in
practice bit for bit) and against a float64 re-implementation of Adam's equations."""

import copy

import pytest
import torch
from _colossal_optim_helpers import make_grads, make_params

from colossal.optim import CPUAdam, HybridAdam

STEPS = 4


def _drive(opt, params, grads_by_step, skip=None):
    """Set grads and step; at step ``skip[0]`` parameter ``skip[1]`` gets no gradient."""
    for t, grads in enumerate(grads_by_step):
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if skip == (t, i) else g.clone()
        opt.step()


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_matches_torch(adamw_mode, flatten, wd):
    ws = make_params(10, torch.float32, zero_index=None)
    grads = [make_grads(10, t, torch.float32, zero_index=None) for t in range(STEPS)]
    ours = [torch.nn.Parameter(w.clone()) for w in ws]
    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd)
    opt = CPUAdam(_groups(ours), adamw_mode=adamw_mode, flatten=flatten, **kw)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls(_groups(ref), foreach=False, **kw)
    _drive(opt, ours, grads, skip=(1, 2))  # one skipped grad: steps diverge, the flat space falls back
    _drive(ref_opt, ref, grads, skip=(1, 2))
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    # our state_dict continues in torch's optimizer and vice versa
    ref_opt2 = ref_cls(_groups([torch.nn.Parameter(p.detach().clone()) for p in ours]), foreach=False, **kw)
    ref_opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    params2 = [p for g in ref_opt2.param_groups for p in g["params"]]
    _drive(opt, ours, grads)
    _drive(ref_opt2, params2, grads)
    for p, r in zip(ours, params2):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)


def adam_reference(ws, grads_by_step, *, lr, betas, eps, wd, bias_correction):
    """AdamW (Loshchilov & Hutter, Algorithm 2 with eta = 1) in float64."""
    b1, b2 = betas
    out = []
    for w, gs in zip(ws, zip(*grads_by_step)):
        w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
        for t, g in enumerate(gs, start=1):
            w = w * (1 - lr * wd)
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            m_hat = m / (1 - b1**t) if bias_correction else m
            v_hat = v / (1 - b2**t) if bias_correction else v
            w = w - lr * m_hat / (v_hat.sqrt() + eps)
        out.append(w)
    return out


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_equations_float64(bias_correction, wd):
    ws = make_params(11)
    grads = [make_grads(11, t) for t in range(STEPS)]
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = HybridAdam(params, lr=0.01, weight_decay=wd, bias_correction=bias_correction)
    _drive(opt, params, grads)
    ref = adam_reference(ws, grads, lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=wd, bias_correction=bias_correction)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)


def test_flat_fast_path_with_real_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref_model = copy.deepcopy(model)
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(5, 8)
    for _ in range(3):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad(set_to_none=False)
            m(x).square().mean().backward()
            o.step()
    space = opt._spaces[0][0]
    base = space.grad_flat.data_ptr()
    assert all(base <= p.grad.data_ptr() < base + space.grad_flat.nbytes for p in model.parameters())
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_params_moved_out_of_flat_buffer_are_refound():
    p = torch.nn.Parameter(torch.ones(4))
    ref = torch.nn.Parameter(torch.ones(4))
    opt, ref_opt = CPUAdam([p], lr=0.1, weight_decay=0.01), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.01)
    for step in range(3):
        if step == 1:
            p.data = p.data.clone()  # what model.to(...) or a checkpoint loader may do
        p.grad, ref.grad = torch.full((4,), 0.5), torch.full((4,), 0.5)
        opt.step(), ref_opt.step()
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights(flatten, dtype):
    ws = make_params(12, torch.float32, zero_index=None)
    grads = [make_grads(12, t, torch.float32, zero_index=None) for t in range(STEPS)]
    low = [torch.nn.Parameter(w.to(dtype)) for w in ws]
    ref = [torch.nn.Parameter(w.to(dtype).float()) for w in ws]  # fp32 reference from the same start
    opt = CPUAdam(low, lr=1e-2, weight_decay=0.01, master_weights=True, flatten=flatten)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    for g_step in grads:
        for p, r, g in zip(low, ref, g_step):
            p.grad = g.to(dtype)
            r.grad = g.to(dtype).float()  # the reference sees the same rounded gradients
        opt.step(), ref_opt.step()
    for p, r in zip(low, ref):
        st = opt.state[p]
        assert st["master"].dtype == st["exp_avg"].dtype == torch.float32 and p.dtype == dtype
        torch.testing.assert_close(st["master"], r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), r.detach().to(dtype))
    # round trip mid-training keeps the fp32 masters fp32
    other = [torch.nn.Parameter(p.detach().clone()) for p in low]
    opt2 = CPUAdam(other, lr=1e-2, weight_decay=0.01, master_weights=True, flatten=flatten)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q, g in zip(low, other, grads[0]):
        p.grad, q.grad = g.to(dtype), g.to(dtype)
    opt.step(), opt2.step()
    for p, q in zip(low, other):
        assert torch.equal(opt.state[p]["master"], opt2.state[q]["master"]) and torch.equal(p, q)


def test_scheduler_and_zero_grad():
    p = torch.nn.Parameter(torch.ones(4))
    opt = CPUAdam([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    p.grad = torch.ones(4)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    opt.zero_grad()
    assert p.grad is None


def test_refuses_sparse_complex_and_bad_args():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        CPUAdam([p]).step()
    c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    c.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match="real"):
        HybridAdam([c]).step()
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([p], betas=(1.0, 0.9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (HybridAdam's accelerator path)")
def test_hybrid_cpu_and_cuda_params_match_torch():
    ws = make_params(13, torch.float32, zero_index=None)
    grads = [make_grads(13, t, torch.float32, zero_index=None) for t in range(STEPS)]
    devices = ["cpu", "cuda", "cpu", "cuda"]
    ours = [torch.nn.Parameter(w.clone().to(d)) for w, d in zip(ws, devices)]
    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = HybridAdam(ours, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    for g_step in grads:
        for p, r, g in zip(ours, ref, g_step):
            p.grad, r.grad = g.to(p.device), g.clone()
        opt.step(), ref_opt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-6, atol=1e-6)
