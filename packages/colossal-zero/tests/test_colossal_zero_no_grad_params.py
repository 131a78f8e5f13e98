"""Parameters without a gradient in a step are left untouched, as ``torch.optim`` leaves them
(``[Note: parameters without a gradient]`` in ``optimizer.py``): no weight decay, no momentum, no
step count. They used to get decay and momentum from zero gradients.

The model skips one block on some steps (every rank, or only rank 0: then the block's gradient is
rank 1's, as with DDP) and holds a never-used layer. Reference: single-process ``torch.optim``
on both ranks' batches (loss averaged over ranks), fp32; worst per-tensor relative error < 1e-5
(summation order only). Covers stages 1-3, offload, and LAMB (per-parameter norms must still line
up across ranks).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.optim import Lamb
from colossal.zero import ZeroOptimizer

V, D, STEPS = 32, 16, 5
SKIP = {1: "all", 2: "all", 3: "rank0"}  # step -> who skips block 1


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
        return Lamb(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (2, 5), generator=g)


def _skips(step, rank):
    who = SKIP.get(step)
    return who == "all" or (who == "rank0" and rank == 0)


def _loss(model, x, y, skip):
    return F.cross_entropy(model(x, skip=skip).reshape(-1, V), y.reshape(-1))


def _reference(kind, rank_dependent, freeze=False):
    torch.manual_seed(0)
    model = SkipNet()
    model.emb.weight.requires_grad_(not freeze)
    init = copy.deepcopy(model.state_dict())
    opt = _make_opt(model.parameters(), kind)
    for step in range(STEPS):
        for r in range(2):
            skip = _skips(step, r) if rank_dependent else _skips(step, 0)
            (_loss(model, *_batch(step, r), skip) / 2).backward()
        opt.step()
        opt.zero_grad()
    return init, model.state_dict()


def _rank(init, kind, rank_dependent, zero_kw, freeze=False):
    model = SkipNet()
    model.load_state_dict(init)
    model.emb.weight.requires_grad_(not freeze)  # frozen but handed to the optimizer: torch skips it
    zero = ZeroOptimizer(_make_opt(model.parameters(), kind), model, **zero_kw)
    r = dist.get_rank()
    for step in range(STEPS):
        skip = _skips(step, r) if rank_dependent else _skips(step, 0)
        zero.backward(_loss(model, *_batch(step, r), skip))
        zero.step()
        zero.zero_grad()
    # a frozen parameter has no master ([Note: frozen parameters] in colossal.zero.optimizer)
    masters = [p.requires_grad for f in zero.flats if f.group_index is not None for p in f.params]
    return zero.full_model_state_dict(), all(masters), any(not p.requires_grad for f in zero.flats for p in f.params)


CASES = [
    ("adamw", False, dict(stage=1, freeze=True)),
    ("adamw", False, dict(stage=2, freeze=True)),
    ("adamw", True, dict(stage=2)),
    ("adamw", False, dict(stage=3)),
    ("adamw", True, dict(stage=2, offload=True)),
    ("adamw", False, dict(stage=3, offload=True, freeze=True)),  # stage 3: every rank runs every module
    ("lamb", True, dict(stage=2)),
]


@pytest.mark.parametrize("kind,rank_dependent,zero_kw", CASES, ids=[f"{c[0]}-{c[2]}-{c[1]}" for c in CASES])
def test_params_without_grad_match_torch(kind, rank_dependent, zero_kw):
    zero_kw = dict(zero_kw)
    freeze = zero_kw.pop("freeze", False)
    init, want = _reference(kind, rank_dependent, freeze)
    for sd, no_frozen_master, frozen_in_flats in run_distributed(
        _rank, 2, init, kind, rank_dependent, zero_kw, freeze, timeout=120
    ):
        assert no_frozen_master
        assert frozen_in_flats == (freeze and zero_kw["stage"] == 3)  # stage 3 shards it; 1/2 keep it whole
        if freeze:
            assert torch.equal(sd["emb.weight"], init["emb.weight"])
        assert torch.equal(sd["unused.weight"], init["unused.weight"])  # never stepped: not even decayed
        for k, v in want.items():
            assert ((sd[k] - v).norm() / v.norm()).item() < 1e-5, k


def _rank_resume(init, zero_kw):
    """Train STEPS steps with a save and reload into a fresh engine after step 2 (the per-parameter
    step counts have diverged by then: they must survive the checkpoint)."""
    r = dist.get_rank()

    def engine():
        model = SkipNet()
        model.load_state_dict(init)
        return ZeroOptimizer(_make_opt(model.parameters(), "adamw"), model, **zero_kw), model

    zero, model = engine()
    for step in range(STEPS):
        if step == 3:
            model_sd, optim_sd = zero.full_model_state_dict(), zero.state_dict()
            zero, model = engine()
            zero.load_full_model_state_dict(model_sd)
            zero.load_state_dict(optim_sd)
        zero.backward(_loss(model, *_batch(step, r), _skips(step, 0)))
        zero.step()
        zero.zero_grad()
    return zero.full_model_state_dict()


@pytest.mark.parametrize("zero_kw", [dict(stage=2), dict(stage=3)], ids=["stage2", "stage3"])
def test_diverged_step_counts_survive_a_checkpoint(zero_kw):
    init, want = _reference("adamw", False)
    for sd in run_distributed(_rank_resume, 2, init, zero_kw, timeout=120):
        for k, v in want.items():
            assert ((sd[k] - v).norm() / v.norm()).item() < 1e-5, k
