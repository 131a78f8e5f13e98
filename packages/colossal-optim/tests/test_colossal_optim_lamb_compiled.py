"""Lamb(fused="compile") (two torch.compile'd passes over the flat buffers) against the float64
reference and against fused="torch". Every test uses the same four tensors (one flat-space
shape per dtype, plus one more size), so the module compiles six small graphs (about 20 s
cold on a 2-core VM, a few seconds with Inductor's on-disk cache)."""

import copy
import os
import shutil

import pytest
import torch
from _colossal_optim_helpers import make_grads, make_params
from test_colossal_optim_lamb import lamb_reference, run_lamb

from colossal.optim import Lamb

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")),
    reason="torch.compile (Inductor) needs a C++ compiler",
)
STEPS = 4
KW = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_compiled_matches_paper_float64(wd, bias_correction):
    # make_params/make_grads include a zero weight (ratio 1) and a zero gradient (||u|| = 0 if wd = 0)
    ws, grads = make_params(0), [make_grads(0, t) for t in range(STEPS)]
    params, opt = run_lamb(ws, grads, [([0, 1, 2, 3], {})], weight_decay=wd, bias_correction=bias_correction,
                           fused="compile", **KW)  # fmt: skip
    assert opt._flats and all(f._scratch is None for f in next(iter(opt._flats.values()))[1])  # compiled path
    ref = lamb_reference(ws, grads, wd=[wd] * 4, bias_correction=bias_correction, adam=False, trust=[True] * 4, **KW)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)


def test_compiled_equals_torch_path_float32():
    ws, grads = make_params(3, torch.float32), [make_grads(3, t, torch.float32) for t in range(STEPS)]
    # two flat spaces of 3 and 1 rows: the second size recompiles with a symbolic row count
    groups = [([0, 1, 2], {}), ([3], {"weight_decay": 0.0, "trust_ratio": False})]
    a, opt_a = run_lamb(ws, grads, groups, weight_decay=0.01, fused="compile", **KW)
    b, opt_b = run_lamb(ws, grads, groups, weight_decay=0.01, fused="torch", **KW)
    for pa, pb in zip(a, b):  # fp32: summation order of the norms and operation order differ
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-6)
    for pa, pb in zip(a, b):  # moments: fp32 rounding of b*m + (1-b)*g differs from torch's kernel
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_a.state[pa][key], opt_b.state[pb][key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("first, second", [("compile", "torch"), ("torch", "compile")])
def test_state_dict_round_trip_between_paths(first, second):
    ws, grads = make_params(4, torch.float32), [make_grads(4, t, torch.float32) for t in range(6)]
    a = [torch.nn.Parameter(w.clone()) for w in ws]
    opt_a = Lamb(a, weight_decay=0.01, fused=first, **KW)
    for t in range(6):
        if t == 3:  # continue the same training under the other path from a state_dict
            b = [torch.nn.Parameter(p.detach().clone()) for p in a]
            opt_b = Lamb(b, lr=1.0, fused=second)
            opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        for i, g in enumerate(grads[t]):
            a[i].grad = g.clone()
            if t >= 3:
                b[i].grad = g.clone()
        opt_a.step()
        if t >= 3:
            opt_b.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-6)
    assert opt_b.state_dict()["state"][0]["step"].item() == 6


def test_fused_value_is_checked():
    with pytest.raises(ValueError, match=r"fused must be one of \('torch', 'compile'\), got 'triton'"):
        Lamb([torch.nn.Parameter(torch.ones(2))], fused="triton")


def test_compile_failure_names_the_fallback(monkeypatch):
    from colossal.optim import _lamb_compiled

    def broken(name):
        def fail(*args):
            raise OSError("no C++ compiler")

        return fail

    monkeypatch.setattr(_lamb_compiled, "_compiled", broken)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"failed \(OSError: no C\+\+ compiler\).*fused='torch'"):
        Lamb([p], fused="compile").step()
