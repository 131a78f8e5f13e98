"""One parameter used by several modules in one forward (``[Note: shared parameters]`` in ``ddp.py``).

* a parent and its child: ``Head`` owns ``bias`` and its child ``decoder`` owns the same ``bias``
  (Hugging Face ``BertForMaskedLM`` ties ``cls.predictions.bias`` to ``cls.predictions.decoder.bias``);
  the parent uses it again after another child (``post``) has run, so its chunk must stay gathered
  until the parent's forward is done;
* two siblings: ``b.weight is a.weight``, with other modules between their uses.

Both run plain, with non-reentrant activation checkpointing and with reentrant checkpointing (each
inner backward accumulates its own part of a shared gradient). Gemini used to raise
``IllegalTransitionError`` (COMPUTE -> COMPUTE) at the child's forward.

Reference: plain PyTorch fp32 Adam on the same model (the mean loss over both ranks' halves of the
batch on 2 ranks); tolerance 1e-5 relative per tensor (same ops; gradients copied through chunk
buffers, their parts summed in another order; Adam element-wise on fp32 masters). The tight budget
is below the model's chunks plus its activations, so chunks are evicted and fetched every step (asserted).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from colossal.comm.testing import run_distributed
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.gemini.chunk import TensorState
from colossal.testkit import assert_close

D, STEPS, CHUNK, BUDGET = 16, 3, 300, 11_000  # BUDGET: about 4/5 of the model chunks plus activations


class Head(nn.Module):
    """A parent sharing its own ``bias`` with its child ``decoder``."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.dense = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(D) * 0.1)
        self.decoder = nn.Linear(D, D)
        if tie:
            self.decoder.bias = self.bias
        self.post = nn.Linear(D, D)

    def forward(self, x):
        y = self.decoder(torch.tanh(self.dense(x)))
        return self.post(y) + self.bias  # the parent's own use, after another child's operator


class SharedNet(nn.Module):
    """``b.weight is a.weight`` (siblings) and ``Head`` (parent and child, unless ``siblings_only``);
    ``ckpt`` picks checkpointing."""

    def __init__(self, ckpt: str, siblings_only: bool = False):
        super().__init__()
        self.ckpt = ckpt
        self.a = nn.Linear(D, D)
        self.mid = nn.Sequential(*[nn.Linear(D, D) for _ in range(4)])
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight
        self.head = Head(tie=not siblings_only)
        self.scale = nn.Parameter(torch.ones(D))  # the root's own: its backward starts outside the checkpoints

    def _run(self, f, x):
        if self.ckpt == "none":
            return f(x)
        return checkpoint(f, x, use_reentrant=self.ckpt == "reentrant")

    def forward(self, x):
        h = self._run(self.a, x)
        h = self._run(self.mid, torch.relu(h))
        h = self._run(self.b, h)
        return self._run(self.head, h) * self.scale


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, D, generator=g) for _ in range(STEPS)]


def _loss(out):
    return out.square().mean()


def _reference(ckpt, siblings_only=False):
    torch.manual_seed(0)
    model = SharedNet(ckpt, siblings_only)
    init = copy.deepcopy(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in _batches():
        opt.zero_grad()
        _loss(model(x.requires_grad_())).backward()  # reentrant checkpointing needs an input with grad
        opt.step()
    return init, model.state_dict()


def _gemini(ckpt, init, siblings_only=False, **kw):
    model = SharedNet(ckpt, siblings_only)
    model.load_state_dict(init)
    gem = GeminiDDP(model, chunk_size=CHUNK, **kw)
    opt = GeminiOptimizer(torch.optim.Adam(gem.parameters(), lr=1e-2), gem)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for x in _batches():
        b = x.shape[0] // world
        opt.backward(_loss(gem(x[rank * b : (rank + 1) * b].requires_grad_())))
        opt.step()
        for c in gem.manager.chunks:  # every user let go, nothing pinned or half-reduced
            assert c.pins == 0 and not c.in_use and c.grad_buffer is None, c
            idle = (TensorState.HOLD, TensorState.FREE)
            assert all(getattr(i, "users", 0) == 0 and i.state in idle for i in c.tensors), c
    moved = sum(s.bytes_to_device for s in gem.stats_history[1:])  # after warm-up
    return gem.state_dict(), moved, max(s.peak_device_bytes for s in gem.stats_history)


def _check(got, ref, moved, peak, budget):
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert_close(got[k], v, what=k)
    if budget is not None:
        assert moved > 0, "the budget was meant to force evictions"
        assert peak <= budget


CKPTS = ["none", "non-reentrant", "reentrant"]
ONE_RANK = [
    dict(placement="auto", device_memory_budget=BUDGET, prefetch=0),
    dict(placement="static", offload_param_frac=1.0, device_memory_budget=BUDGET, prefetch=0),
    dict(placement="auto", device_memory_budget=1 << 30),
]


@pytest.mark.parametrize("kw", ONE_RANK, ids=["auto-tight", "static-tight", "roomy"])
@pytest.mark.parametrize("ckpt", CKPTS)
def test_shared_parameters_train_like_torch_on_one_rank(ckpt, kw):
    init, ref = _reference(ckpt)
    got, moved, peak = _gemini(ckpt, init, **kw)
    _check(got, ref, moved, peak, kw["device_memory_budget"] if kw["device_memory_budget"] < 1 << 20 else None)


TWO_RANKS = [  # (checkpointing, siblings only, GeminiDDP keywords, budget that must force evictions or None)
    ("none", False, dict(placement="auto", device_memory_budget=BUDGET, prefetch=2), BUDGET),
    ("none", False, dict(placement="static", offload_param_frac=1.0, device_memory_budget=BUDGET), BUDGET),
    ("reentrant", False, dict(placement="auto", device_memory_budget=BUDGET, prefetch=0), BUDGET),
    ("non-reentrant", False, dict(placement="auto", device_memory_budget=BUDGET, prefetch=2), BUDGET),
    ("none", False, dict(keep_gathered=True, device_memory_budget=1 << 30), None),
    ("reentrant", False, dict(keep_gathered=True, device_memory_budget=1 << 30), None),
    # siblings only, each use in its own reentrant recomputation: each inner backward accumulates its own
    # part of a.weight's gradient (replicated chunks: a part after the chunk's all-reduce is all-reduced too)
    ("reentrant", True, dict(placement="auto", device_memory_budget=BUDGET, prefetch=0), BUDGET),
    ("reentrant", True, dict(keep_gathered=True, device_memory_budget=1 << 30), None),
]


def _rank(cases, inits):
    return [_gemini(ckpt, inits[ckpt, sib], siblings_only=sib, **kw) for ckpt, sib, kw, _ in cases]


def test_shared_parameters_train_like_torch_on_two_ranks():
    refs = {(c, sib): _reference(c, sib) for c, sib, _, _ in TWO_RANKS}
    inits = {key: init for key, (init, _) in refs.items()}
    for results in run_distributed(_rank, 2, TWO_RANKS, inits, timeout=120):
        for (ckpt, sib, _, budget), (got, moved, peak) in zip(TWO_RANKS, results):
            _check(got, refs[ckpt, sib][1], moved, peak, budget)
