"""PaLM under the hybrid plugin's built-in policy (``colossalai.policies.PaLMPolicy``): 1D tensor
parallel (vocab-parallel tied embedding, column/row SwiGLU, replicated multi-query key/value
head), sequence parallel (ring attention, RoPE at global positions) and both, against the same
model trained by plain PyTorch.

Tolerance: fp32, 1e-5 relative per-step loss (only the order of sums changes).
"""

import torch
import torch.nn.functional as F
from plan_harness import boosted_losses, dense_losses

from colossal.comm.testing import run_distributed
from colossalai import HybridParallelPlugin
from colossalai.models import PaLM, palm_config

B, T, V = 8, 16, 64


def _build():
    return PaLM(palm_config("palm-tiny", vocab_size=V, block_size=T))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [{"ids": torch.randint(0, V, (B, T + 1), generator=g)} for _ in range(3)]


def _loss(model, batch):
    ids = batch["ids"]
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


LAYOUTS = {2: [dict(tp_size=2), dict(tp_size=1, sp_size=2)], 4: [dict(tp_size=2, sp_size=2, sp_kind="all_to_all")]}


def _run(world):
    return [boosted_losses(HybridParallelPlugin(**kw), _build, _batches(), _loss) for kw in LAYOUTS[world]]


def test_palm_hybrid_matches_plain_pytorch():
    ref = torch.tensor(dense_losses(_build, _batches(), _loss))
    for world in (2, 4):
        for rank_runs in run_distributed(_run, world, world, timeout=180):
            for kw, losses in zip(LAYOUTS[world], rank_runs, strict=True):
                torch.testing.assert_close(
                    torch.tensor(losses), ref, rtol=1e-5, atol=0, msg=lambda m, kw=kw: f"{kw}: {m}"
                )
