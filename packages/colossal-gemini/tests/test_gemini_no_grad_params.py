"""Parameters without a gradient in a step are left untouched, as ``torch.optim`` leaves them
(``[Note: parameters without a gradient]`` in ``optimizer.py``): no weight decay, no momentum, no
step count. A never-used layer and a block skipped on some steps by every rank (Gemini
issues its gathers and gradient reductions chunk by chunk as modules run, so every rank must run
the same modules; skipping on one rank only is not supported). Reference: single-process ``torch.optim`` on
every rank's batch (loss averaged), fp32, 1e-5 relative per tensor. LAMB checks that the
per-parameter norm vectors still line up across ranks.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.optim import Lamb

V, D, STEPS = 32, 16, 4
SKIP = {1, 2}  # steps on which every rank skips block 1


class SkipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.unused = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, x, skip=False):
        h = self.emb(x)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                h = h + block(h)
        return self.head(h)  # (B, T, V)


def _make_opt(params, kind):
    if kind == "lamb":
        return Lamb(params, lr=1e-2, weight_decay=0.1, flatten=False)  # Gemini keeps its own flat chunks
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (2, 5), generator=g)


def _skips(step):
    return step in SKIP


def _loss(model, x, y, skip):
    return F.cross_entropy(model(x, skip=skip).reshape(-1, V), y.reshape(-1))


def _reference(kind, world):
    torch.manual_seed(0)
    model = SkipNet()
    init = copy.deepcopy(model.state_dict())
    opt = _make_opt(model.parameters(), kind)
    for step in range(STEPS):
        for r in range(world):
            (_loss(model, *_batch(step, r), _skips(step)) / world).backward()
        opt.step()
        opt.zero_grad()
    return init, model.state_dict()


def _train(init, kind, **kw):
    model = SkipNet()
    model.load_state_dict(init)
    gem = GeminiDDP(model, device_memory_budget=1 << 24, chunk_size=512, **kw)
    opt = GeminiOptimizer(_make_opt(gem.parameters(), kind), gem)
    r = dist.get_rank() if dist.is_initialized() else 0
    for step in range(STEPS):
        opt.backward(_loss(gem, *_batch(step, r), _skips(step)))
        opt.step()
    return gem.state_dict()


def _check(sd, init, want):
    assert torch.equal(sd["unused.weight"], init["unused.weight"])  # never stepped: not even decayed
    for k, v in want.items():
        assert ((sd[k] - v).norm() / v.norm()).item() < 1e-5, k


def test_single_process_matches_torch():
    init, want = _reference("adamw", 1)
    _check(_train(init, "adamw"), init, want)


@pytest.mark.parametrize("kind,kw", [("adamw", {}), ("lamb", {}), ("adamw", {"keep_gathered": True})])
def test_two_ranks_match_torch(kind, kw):
    init, want = _reference(kind, 2)
    for sd in run_distributed(_train, 2, init, kind, timeout=120, **kw):
        _check(sd, init, want)
