"""Dropout RNG: same mask on every rank where the tensor is replicated, different masks where it
is split, and the default stream is left untouched."""

import torch
import torch.distributed as dist
from torch import nn

from colossal.comm import all_gather_list
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import DropoutMode, ParallelDropout, RNGTracker


def _masks():
    torch.manual_seed(100 + dist.get_rank())  # default streams differ per rank on purpose
    before = torch.get_rng_state()
    tracker = RNGTracker.from_group(seed=1234, group=dist.group.WORLD)
    x = torch.ones(64, 64)
    rep = ParallelDropout.from_dense(nn.Dropout(0.5), tracker, DropoutMode.REPLICATED)
    split = ParallelDropout(0.5, tracker, "split")
    m_rep, m_split = rep(x) != 0, split(x) != 0
    assert torch.equal(torch.get_rng_state(), before), "the default RNG stream must be restored"
    reps, splits = all_gather_list(m_rep.float()), all_gather_list(m_split.float())
    assert all(torch.equal(reps[0], m) for m in reps), "replicated masks differ across ranks"
    assert not any(torch.equal(splits[0], m) for m in splits[1:]), "split masks repeat across ranks"
    assert not torch.equal(rep(x) != 0, m_rep), "the stream must advance between calls"
    assert 0.4 < m_split.float().mean() < 0.6


def test_dropout_masks_follow_replication():
    run_distributed(_masks, 2, timeout=60)
