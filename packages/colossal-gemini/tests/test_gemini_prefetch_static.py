"""Prefetch with ``placement="static"``: the plan must leave room for the chunks the static policy
never evicts (its device homes), so a budget that trains with ``prefetch=0`` also trains with
prefetching (it used to raise BudgetExceededError mid-training).

Reference: plain PyTorch on both ranks' batches (loss averaged over ranks), fp32, 1e-5 relative;
the ranks use different sequence lengths, so their non-model data differ. The attention key bias
is excluded (its true gradient is exactly zero: see test_gemini_dist).
"""

import copy
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from colossal.comm.testing import run_distributed

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from colossal.gemini import GeminiDDP, GeminiOptimizer  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss  # noqa: E402

BUDGET = 600_000
STEPS = 4


def _batches():
    out = []
    for s in range(STEPS):
        per_rank = []
        for r, t in enumerate((8, 24)):
            g = torch.Generator().manual_seed(10 * s + r)
            per_rank.append((torch.randint(0, 256, (2, t), generator=g), torch.randint(0, 256, (2, t), generator=g)))
        out.append(per_rank)
    return out


def _reference(batches):
    torch.manual_seed(0)
    model = GPT(GPTConfig(init="torch"))
    init = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for per_rank in batches:
        for x, y in per_rank:
            (lm_loss(model(x), y) / len(per_rank)).backward()
        opt.step()
        opt.zero_grad()
    return init, model.state_dict()


def _rank(batches, init, prefetch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(init="torch"))
    model.load_state_dict(init)
    kw = dict(offload_param_frac=0.5, offload_optim_frac=0.5, device_memory_budget=BUDGET, prefetch=prefetch)
    gem = GeminiDDP(model, placement="static", chunk_size=8192, **kw)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    for per_rank in batches:
        x, y = per_rank[dist.get_rank()]
        opt.backward(lm_loss(gem(x), y))
        opt.step()
    depths = [len(a) for a in gem.prefetcher.ahead] if gem.prefetcher else []
    return gem.state_dict(), depths, max(s.peak_device_bytes for s in gem.stats_history)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_static_placement_with_prefetch_trains_where_prefetch_0_does(prefetch):
    batches = _batches()
    init, ref = _reference(batches)
    results = run_distributed(_rank, 2, batches, init, prefetch, timeout=150)
    for state, depths, peak in results:
        assert peak <= BUDGET
        assert depths == results[0][1]  # the same plan on every rank
        for k, v in ref.items():
            if not k.endswith("k_proj.bias"):
                assert_close(state[k], v)
    if prefetch:
        assert any(results[0][1])  # something is still prefetched
