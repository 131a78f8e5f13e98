"""Flat-buffer LAMB/LARS (flatten=True) against the per-tensor path (flatten=False).

Both paths implement the same equations (checked against float64 references in the LAMB and
LARS test files); here: float64, so only the summation order of the norms differs (1e-12), with
a parameter missing its gradient on one step (the flat space falls back to per-tensor updates
for that step), state_dicts moved between the two layouts mid-training, and padding that stays zero.
"""

import copy

import pytest
import torch
from _colossal_optim_helpers import make_grads, make_params

from colossal.optim import Lamb, Lars

STEPS = 5
KWARGS = {
    Lamb: dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.99)),
    Lars: dict(lr=1.0, weight_decay=1e-3, momentum=0.9, eta=0.02),
}


def _params(seed):
    big = torch.randn(3000, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return [torch.nn.Parameter(w.clone()) for w in [*make_params(seed), big]]


def _grads(seed, t):
    gen = torch.Generator().manual_seed(seed * 100 + t)
    return [*make_grads(seed, t), torch.randn(3000, 5, dtype=torch.float64, generator=gen)]


def _step(opt, params, t, seed, skip=None):
    for i, (p, g) in enumerate(zip(params, _grads(seed, t))):
        p.grad = None if i == skip else g.clone()
    opt.step()


@pytest.mark.parametrize("cls", [Lamb, Lars])
def test_flat_equals_per_tensor_with_a_skipped_gradient(cls):
    runs = []
    for flatten in (True, False):
        params = _params(7)
        groups = [{"params": params[:3] + params[4:]}, {"params": params[3:4], "weight_decay": 0.0}]
        opt = cls(groups, flatten=flatten, **KWARGS[cls])
        for t in range(STEPS):
            _step(opt, params, t, 7, skip=1 if t == 2 else None)
        runs.append(params)
    for a, b in zip(*runs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-14)
    assert runs[0][0].data_ptr() != runs[1][0].data_ptr()


@pytest.mark.parametrize("cls", [Lamb, Lars])
@pytest.mark.parametrize("to_flat", [True, False])
def test_state_dict_moves_between_layouts(cls, to_flat):
    a = _params(8)
    opt_a = cls(a, flatten=not to_flat, **KWARGS[cls])
    for t in range(2):
        _step(opt_a, a, t, 8)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = cls(b, flatten=to_flat, **{**KWARGS[cls], "lr": 123.0})
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for t in range(2, STEPS):
        _step(opt_a, a, t, 8)
        _step(opt_b, b, t, 8)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-12, atol=1e-14)


def test_padding_stays_zero_and_params_are_views():
    params = _params(9)
    opt = Lamb(params, **KWARGS[Lamb])
    for t in range(3):
        _step(opt, params, t, 9)
    (flat,) = opt._flats[id(opt.param_groups[0])][1]
    space = flat.space
    mask = torch.ones(space.param_flat.numel(), dtype=torch.bool)
    for p, sl in zip(space.params, space.slices):
        assert p.data_ptr() == space.param_flat[sl].data_ptr()
        mask[sl] = False
    for buf in (space.param_flat, space.grad_flat, space.exp_avg, space.exp_avg_sq, flat.scratch()):
        assert torch.count_nonzero(buf[mask]) == 0


@pytest.mark.parametrize("cls", [Lamb, Lars])
def test_views_into_a_foreign_buffer_stay_in_place(cls):
    # ZeRO hands layer-wise optimizers 1-D views of its master shard: updates must land there.
    master = torch.randn(3000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    views = [torch.nn.Parameter(master[:1000]), torch.nn.Parameter(master[1000:])]
    ref = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opts = [cls(views, **KWARGS[cls]), cls(ref, flatten=False, **KWARGS[cls])]
    for t in range(3):
        gen = torch.Generator().manual_seed(t)
        grads = [torch.randn(1000, dtype=torch.float64, generator=gen), torch.randn(2000, dtype=torch.float64)]
        for ps, opt in zip((views, ref), opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    assert views[0].data_ptr() == master.data_ptr()
    torch.testing.assert_close(master, torch.cat([r.detach() for r in ref]), rtol=0, atol=0)
