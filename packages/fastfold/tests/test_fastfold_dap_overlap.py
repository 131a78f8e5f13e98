"""The pair all-to-alls of DAP overlap compute (see [Note: overlapping the pair all-to-alls]):
every one is issued asynchronously, and layer norms (the MSA stack, the next update's prologue)
run between its start and its wait, forward and backward; ``Dap(overlap=False)`` and other piece
counts give the same results (float64, 1e-9: only summation order differs)."""

import time

import torch
from fastfold_testutils import rand, rand_mask, randomize_, tiny_evo, tiny_template

from colossal.comm import register_observer
from colossal.comm.testing import run_distributed
from fastfold import Dap, EvoformerStack, TemplatePairStack
from fastfold.ops import LayerNorm
from fastfold.parallel import PAIR_A2A_TAG

TOL = dict(rtol=1e-9, atol=1e-9)


def _mark_layer_norms(model, marks):
    stamp = lambda *_: marks.append(time.perf_counter())
    for mod in model.modules():
        if isinstance(mod, LayerNorm):
            mod.register_forward_hook(stamp)
            mod.register_full_backward_hook(stamp)


def rank_pair_all_to_all_timeline(overlap):
    """(tag, async, a layer norm ran inside [start, wait]) per pair all-to-all, forward then backward."""
    model = randomize_(EvoformerStack(tiny_evo(no_blocks=2)).double()).eval()
    marks, events = [], []
    _mark_layer_norms(model, marks)
    handle = register_observer(events.append)
    try:
        m, z = rand(4, 6, 12).requires_grad_(), rand(6, 6, 8).requires_grad_()
        out = model(m, z, dap=Dap(overlap=overlap))
        sum(o.sum() for o in out).backward()
    finally:
        handle.remove()
    pair = [e for e in events if e.tag.startswith(PAIR_A2A_TAG)]
    return [(e.tag, e.async_op, any(e.start < t < e.end for t in marks)) for e in pair]


def test_pair_all_to_alls_are_async_and_overlap_compute():
    """Per block and direction: the column->row switch at the block start (hidden behind the MSA
    stack) and the 3 pipelined switches of the pair stack (2 pieces each: the second piece moves
    while the first one's prologue runs) -> 7 async all-to-alls, 4 of them with compute inside."""
    timeline = run_distributed(rank_pair_all_to_all_timeline, 2, True, timeout=120)[0]
    fwd = [t for t in timeline if not t[0].endswith(".bwd")]
    bwd = [t for t in timeline if t[0].endswith(".bwd")]
    assert len(fwd) == len(bwd) == 2 * 7
    assert all(is_async for _, is_async, _ in timeline)
    assert sum(busy for *_, busy in fwd) >= 2 * 4
    assert sum(busy for *_, busy in bwd) >= 2 * 4


def test_overlap_false_is_synchronous():
    timeline = run_distributed(rank_pair_all_to_all_timeline, 2, False, timeout=120)[0]
    assert len(timeline) == 2 * 2 * 4  # one unpipelined switch per layout change, forward and backward
    assert not any(is_async or busy for _, is_async, busy in timeline)


def _outputs_and_grads(model, args, n_grad, **kw):
    model.zero_grad()
    args = [a.detach().requires_grad_(i < n_grad) for i, a in enumerate(args)]
    outs = model(*args, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o * rand(*o.shape, seed=9 + i)).sum() for i, o in enumerate(outs)).backward()
    grads = [a.grad for a in args[:n_grad]] + [p.grad.clone() for p in model.parameters()]
    return list(outs), grads


def rank_overlap_modes_agree():
    """overlap=True with 1, 2 and 3 pieces and overlap=False give the same outputs and gradients
    (per rank, before reduce_gradients), R=7 padded to 8 (4 local rows: 3 pieces are uneven)."""
    evo = randomize_(EvoformerStack(tiny_evo()).double()).eval()
    evo_args = [rand(3, 7, 12, seed=1), rand(7, 7, 8, seed=2), rand_mask(3, 7, seed=3), rand_mask(7, 7, seed=4)]
    tmpl = randomize_(TemplatePairStack(tiny_template()).double()).eval()
    tmpl_args = [rand(2, 7, 7, 8, seed=5), rand_mask(2, 7, 7, seed=6)]
    for model, args, n_grad in ((evo, evo_args, 2), (tmpl, tmpl_args, 1)):
        ref = _outputs_and_grads(model, args, n_grad, dap=Dap(overlap=False))
        for pieces in (1, 2, 3):
            got = _outputs_and_grads(model, args, n_grad, dap=Dap(pieces=pieces))
            for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
                torch.testing.assert_close(a, b, **TOL)
    return True


def test_overlap_modes_agree():
    assert run_distributed(rank_overlap_modes_agree, 2, timeout=180) == [True, True]
