"""Hierarchical data parallel (a shard group inside a replicate group, from a colossal.comm Mesh)
matches single-process training; unused parameters and parameters that get no gradient on some
rank neither hang nor corrupt anything."""

import pytest
import torch
import torch.distributed as dist
from colossal_zero_testutil import B, loss_of, make_model, max_rel_err, rank_batch, reference, train_zero
from torch import nn

from colossal.comm import Mesh
from colossal.comm.testing import run_distributed
from colossal.testkit import Block
from colossal.zero import ZeroOptimizer

STEPS = 3


def hsdp_cases():
    mesh = Mesh(axes={"rep": 2, "shard": 2})
    groups = dict(group=mesh.group("shard"), replicate_group=mesh.group("rep"))
    cases = [train_zero(STEPS, stage=stage, **groups) for stage in (1, 2, 3)]
    # Accumulation over two reducing backward passes: stage 1 must not count the first pass's
    # sum once per replica (see the reducer's [Note: accumulating across backward passes]).
    cases += [train_zero(STEPS, accum=2, stage=stage, **groups) for stage in (1, 2)]
    return cases


def test_hsdp_matches_reference():
    ref, ref_losses = reference(STEPS, 4)
    ref2, ref2_losses = reference(STEPS, 4, accum=2)
    for per_rank in run_distributed(hsdp_cases, 4, timeout=180):
        for i, (sd, losses) in enumerate(per_rank):
            want, want_losses = (ref, ref_losses) if i < 3 else (ref2, ref2_losses)
            assert max_rel_err(sd, want) < 1e-5, i
            assert losses == pytest.approx(want_losses, rel=1e-5), i


class Gated(nn.Module):
    """The GPT plus a never-used layer and a layer used only on even ranks."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model()
        self.unused = nn.Linear(64, 64)
        self.sometimes = nn.ModuleList([nn.Linear(64, 64)])

    def forward(self, x, use: bool):
        h = self.gpt(x)  # (B, T, V)
        return h + self.sometimes[0](h) if use else h


def unused_case(stage):
    model = Gated()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    # Stage 3 gathers a unit with a collective, so (as with FSDP) every rank must run the forward
    # of every unit: the rank-dependent layer stays in the root unit (only Blocks are units).
    zero = ZeroOptimizer(opt, model, stage=stage, bucket_numel=500, wrap_policy=(Block,))
    unused_before = model.unused.weight.detach().clone() if stage != 3 else None
    for step in range(STEPS):
        x, y = rank_batch(step, 0, 1, dist.get_world_size(), dist.get_rank())
        zero.backward(loss_of(lambda i: model(i, use=dist.get_rank() % 2 == 0), x, y))
        zero.step()
        zero.zero_grad()
    sd = zero.full_model_state_dict()
    return sd, unused_before


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_and_rank_dependent_parameters(stage):
    out = run_distributed(unused_case, 2, stage, timeout=120)
    (sd0, _), (sd1, _) = out
    for k in sd0:
        assert torch.isfinite(sd0[k]).all(), k
        assert torch.equal(sd0[k], sd1[k]), k  # every rank holds the same model
    torch.manual_seed(0)
    fresh = Gated()
    assert torch.equal(sd0["unused.weight"], fresh.unused.weight)  # zero gradient, no decay: unchanged
    assert not torch.equal(sd0["sometimes.0.weight"], fresh.sometimes[0].weight)  # rank 0's gradient arrived
    assert B == 2
