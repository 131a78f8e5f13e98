"""Layer-wise optimizers (LARS, LAMB) resume from a Gemini checkpoint exactly: their scalar states
differ per parameter (LARS's ``state["scale"]`` interprets its momentum buffer), so checkpoints keep
them per parameter name (``optim/<name>/<key>``), in the full and in the sharded (flat-slice) form.

Reference: the uninterrupted Gemini run; the resumed run (saved after 3 steps, loaded into a fresh
model and optimizer, also on another world size) continues 2 steps and must match it to 1e-5
relative (fp32, the same updates; only summation order differs across world sizes). Across world
sizes the attention key bias is excluded: its true gradient is exactly zero (softmax shift
invariance), so both runs only see rounding noise there, which LAMB/LARS normalise.
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
from colossal.gemini.checkpoint import (  # noqa: E402
    load_optimizer_state_dict,
    load_sharded,
    optimizer_state_dict,
    save_sharded,
)
from colossal.optim import Lamb, Lars  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, random_batches  # noqa: E402

SAVE_AT, STEPS = 3, 5


def _setup(kind, state):
    model = GPT(GPTConfig(init="torch"))
    model.load_state_dict(state)
    gem = GeminiDDP(model, device_memory_budget=10_000_000, chunk_size=8192)
    if kind == "lars":
        inner = Lars(gem.parameters(), lr=0.5, momentum=0.9, flatten=False)
    else:
        inner = Lamb(gem.parameters(), lr=1e-2, flatten=False)
    return gem, GeminiOptimizer(inner, gem)


def _steps(gem, opt, batches):
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for x, y in batches:
        b = x.shape[0] // world
        opt.backward(lm_loss(gem(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b]))
        opt.step()


def _save(kind, init, batches, path):
    """Train, checkpoint after SAVE_AT steps (full state returned, sharded written to ``path``), finish."""
    gem, opt = _setup(kind, init)
    _steps(gem, opt, batches[:SAVE_AT])
    full = (gem.state_dict(), optimizer_state_dict(opt))
    save_sharded(path, gem, opt)
    _steps(gem, opt, batches[SAVE_AT:])
    return full, gem.state_dict()


def _resume(kind, init, batches, full, path):
    gem, opt = _setup(kind, init)
    if full is not None:
        gem.load_state_dict(full[0])
        load_optimizer_state_dict(opt, full[1])
    else:
        load_sharded(path, gem, opt)
    _steps(gem, opt, batches[SAVE_AT:])
    return gem.state_dict()


def _run(fn, world, *args):
    return [fn(*args)] if world == 1 else run_distributed(fn, world, *args, timeout=120)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
@pytest.mark.parametrize("form", ["full", "sharded"])
@pytest.mark.parametrize("worlds", [(1, 1), (2, 2), (2, 1), (1, 2)], ids=lambda w: f"{w[0]}to{w[1]}")
def test_layerwise_optimizer_resumes_exactly(kind, form, worlds, tmp_path):
    batches = random_batches(STEPS, batch=2, seq=8)
    torch.manual_seed(0)
    init = copy.deepcopy(GPT(GPTConfig(init="torch")).state_dict())
    path = str(tmp_path / "ckpt")
    (full, _), *_ = saved = _run(_save, worlds[0], kind, init, batches, path)
    ref = saved[0][1]
    if form == "full":
        scales = {float(s["scale"]) for s in full[1]["state"].values()} if kind == "lars" else set()
        assert kind != "lars" or len(scales) > 1  # per-parameter scalars really differ
    for got in _run(_resume, worlds[1], kind, init, batches, full if form == "full" else None, path):
        for k, v in ref.items():
            if worlds[0] == worlds[1] or not k.endswith("k_proj.bias"):
                assert_close(got[k], v)
