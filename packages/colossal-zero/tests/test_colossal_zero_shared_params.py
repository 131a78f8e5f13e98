"""Stage 3 with a parameter shared between modules in different units (``[Note: shared parameters]``
in ``stage3.py``): an embedding at the root tied to a root-level ``nn.Linear`` head, with
``wrap_policy=(nn.Linear,)``. The shared weight used to be assigned to the head's unit and freed
while the root's embedding ran (``RuntimeError: setStorage ... out of bounds``).

Reference: single-process PyTorch AdamW on the global batch, fp32; worst per-tensor relative error
< 1e-5 (summation order only).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer
from colossal.zero.stage3 import assign_params, find_units

V, D, STEPS = 32, 16, 3


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.body = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)  # (B, T, D)
        for lin in self.body:
            h = h + torch.tanh(lin(h))
        return self.head(h)  # (B, T, V)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def _rank(init):
    model = TiedHead()
    model.load_state_dict(init)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=3, wrap_policy=(nn.Linear,))
    r, w = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x, y = _batch(step)
        b = x.shape[0] // w
        zero.backward(_loss(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]))
        zero.step()
        zero.zero_grad()
    return zero.full_model_state_dict()


def test_tied_embedding_and_linear_head_train_under_stage3():
    torch.manual_seed(0)
    ref = TiedHead()
    init = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        _loss(ref, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    for sd in run_distributed(_rank, 2, init, timeout=120):
        for k, v in ref.state_dict().items():
            assert ((sd[k] - v).norm() / v.norm()).item() < 1e-5, k


def test_shared_parameter_goes_to_the_unit_enclosing_all_its_users():
    model = TiedHead()
    units = find_units(model, (nn.Linear,))
    groups = assign_params(model, units)
    assert units[0] is model and any(p is model.emb.weight for p in groups[0])  # root: the embedding is there
    outer = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    outer[1][1].weight = outer[1][0].weight  # shared inside one wrapped Sequential: that unit, not the root
    units = find_units(outer, lambda m: isinstance(m, nn.Sequential) or isinstance(m, nn.Linear))
    groups = assign_params(outer, units)
    owner = next(i for i, g in enumerate(groups) if any(p is outer[1][0].weight for p in g))
    assert units[owner] is outer[1]
