"""keep_gathered=True with a block skipped on one rank only (rank 1 runs blocks 0 and 2, rank 0 all three).

Whole chunks on every rank make a rank-dependent forward legal, but the per-chunk all-reduces must
still pair the same chunk on every rank: the skipping rank's chunk completes only at the end of
backward. Reference: torch DDP (``find_unused_parameters=True``) + ``torch.optim.AdamW`` on the same
initial weights and the same per-rank data, in the same processes; fp32, 1e-5 relative per tensor
(both sum the same two per-rank gradients and divide by 2; the rest is element-wise). With equal-sized
chunks a wrong pairing is silent, so the parity is the test. Roomy budget (resident fast path) and a
budget that evicts whole chunks (operator hooks).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.testkit import assert_close

STEPS = 3
SKIPPED = 1  # the block rank 1 skips
CHUNK = 544  # two 16x16 linears with biases: every chunk the same size


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, 16)
        for i, block in enumerate(self.blocks):
            if i != skip:
                h = h + block(h)
        return self.out(h)  # (B, 4)


def _data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def _rank_fn(budget: int) -> dict:
    rank = dist.get_rank()
    skip = SKIPPED if rank == 1 else None
    torch.manual_seed(0)
    init = copy.deepcopy(_Net().state_dict())

    ref = _Net()
    ref.load_state_dict(init)
    ddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for x, y in _data(rank):
        nn.functional.mse_loss(ddp(x, skip), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model = _Net()
    model.load_state_dict(init)
    gem = GeminiDDP(model, device_memory_budget=budget, chunk_size=CHUNK, keep_gathered=True)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    for x, y in _data(rank):
        opt.backward(nn.functional.mse_loss(gem(x, skip), y))
        opt.step()
    sizes = {c.size for c in gem.manager.chunks}
    return {"got": gem.state_dict(), "want": ref.state_dict(), "sizes": sizes, "n": len(gem.manager.chunks)}


@pytest.mark.parametrize("budget", [10_000_000, 16_000], ids=["roomy", "pressure"])
def test_block_skipped_on_one_rank_matches_ddp(budget):
    results = run_distributed(_rank_fn, 2, budget, timeout=120)
    for rank, r in enumerate(results):
        assert r["sizes"] == {CHUNK} and r["n"] >= 4  # equal-sized chunks: a wrong pairing would be silent
        for name, want in r["want"].items():
            assert_close(r["got"][name], want, f"rank {rank} {name}", tol=1e-5)
    for name, want in results[0]["got"].items():  # replicas stay identical
        torch.testing.assert_close(results[1]["got"][name], want, rtol=0, atol=0)
