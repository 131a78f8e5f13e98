"""Vocab-parallel cross-entropy behaves like ``torch.nn.functional.cross_entropy``: rows whose
target is ``ignore_index`` (-100, the padding label of PyTorch and Hugging Face) get no loss and
no gradient and are not counted by the mean, ``label_smoothing`` matches, and a target outside the
vocabulary raises ValueError on every rank before any collective. They used to count in the loss
and get gradients, and an out-of-range target gave no error.

Reference: torch's own cross_entropy on the gathered logits, fp32; 1e-5 relative (a log-sum-exp
summed in another order).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.comm import Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import Grid2D, cross_entropy_1d, cross_entropy_2d, split_input_2d, two_d
from colossal.testkit import assert_close

V, ROWS = 12, 10


def _logits_and_targets(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, V, generator=g)
    target = torch.randint(0, V, (ROWS,), generator=g)
    target[[1, 4, 5]] = -100  # padding
    return logits, target


def _one_d_cases():
    group, p, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    logits, target = _logits_and_targets()
    out = []
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.1):
            full = logits.clone().requires_grad_()
            want = nn.functional.cross_entropy(full, target, reduction=reduction, label_smoothing=smoothing)
            want.backward(torch.ones_like(want))
            part = logits.chunk(p, -1)[r].clone().requires_grad_()
            got = cross_entropy_1d(part, target, group, reduction=reduction, label_smoothing=smoothing)
            got.backward(torch.ones_like(got))
            out.append((reduction, smoothing, got.detach(), want.detach(), part.grad, full.grad.chunk(p, -1)[r]))
    errors = []
    for bad in (V, -1, -7):
        t = target.clone()
        t[0] = bad
        try:
            cross_entropy_1d(logits.chunk(p, -1)[r], t, group)
        except ValueError as e:
            errors.append(str(e))
    dist.barrier()  # no rank is left inside a collective
    return out, errors


def test_1d_matches_torch_with_ignore_index_and_label_smoothing():
    for out, errors in run_distributed(_one_d_cases, 2, timeout=120):
        for reduction, smoothing, got, want, grad, want_grad in out:
            what = f"{reduction}, label_smoothing={smoothing}"
            assert_close(got, want, f"loss ({what})")
            assert_close(grad, want_grad, f"logits grad ({what})")
            assert (grad[[1, 4, 5]] == 0).all()  # padded rows get no gradient
        assert len(errors) == 3 and all("outside [0, 12)" in e for e in errors), errors


def _two_d_mean():
    mesh = Mesh(axes={"tp": 4})
    grid = Grid2D.of(mesh.layout("2d", "tp"))
    torch.manual_seed(0)
    b, s, h = 4, 3, 8
    head = nn.Linear(h, V, bias=False)
    x = torch.randn(b, s, h, requires_grad=True)
    tgt = torch.randint(0, V, (b, s))
    tgt[0, :] = -100  # all of one row block's first sample is padding: the count must be global
    tgt[3, 1] = -100
    loss = nn.functional.cross_entropy(head(x).flatten(0, 1), tgt.flatten())
    loss.backward()
    par = two_d.VocabParallelLMHead2D.from_dense(head, grid)
    xp = split_input_2d(x.detach(), grid).clone().requires_grad_()
    lp = cross_entropy_2d(par(xp), tgt, grid)
    lp.backward()
    bad = tgt.clone()
    bad[2, 2] = V  # held by one row block only: every rank still raises (checked on the full target)
    with pytest.raises(ValueError, match="outside"):
        cross_entropy_2d(par(xp), bad, grid)
    return lp.detach(), loss.detach(), xp.grad, split_input_2d(x.grad, grid)


def test_2d_mean_counts_the_rows_not_ignored_over_every_row_block():
    for lp, loss, grad, want_grad in run_distributed(_two_d_mean, 4, timeout=180):
        assert_close(lp, loss, "2d loss")
        assert_close(grad, want_grad, "2d head input grad")
