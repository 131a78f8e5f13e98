"""Lazy construction: a meta-device model is materialised chunk by chunk straight into the tiers."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemini_helpers import reference_gpt_run  # noqa: E402

from colossal.gemini import GeminiDDP, GeminiOptimizer  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, random_batches  # noqa: E402


def test_meta_model_materialised_by_name_trains_like_the_eager_one():
    batches = random_batches(2, batch=1, seq=8)
    init, ref_state, _ = reference_gpt_run(batches)
    with torch.device("meta"):
        model = GPT(GPTConfig(init="torch"))
    filled = []

    def init_fn(name, tensor):
        assert tensor.device.type == "cpu" and not tensor.is_meta
        filled.append(name)
        tensor.copy_(init[name])

    gem = GeminiDDP(model, device_memory_budget=200_000, chunk_size=8192, param_init_fn=init_fn)
    assert len(filled) == len(set(filled)) == len(dict.fromkeys(GPT(GPTConfig(init="torch")).parameters()))
    assert gem.manager.device.used_bytes == 0 and gem.manager.device.peak_bytes <= gem.manager.chunk_size * 4
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    for x, y in batches:
        opt.backward(lm_loss(gem(x), y))
        opt.step()
    state = gem.state_dict()
    for k, v in ref_state.items():
        assert_close(state[k], v)
