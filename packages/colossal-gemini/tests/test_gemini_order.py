"""Packing in first-use order (``example_inputs``): a meta-device forward at construction orders the chunks.

A stack whose layers run in reverse registration order is packed in run order (so the traced chunk
sequence of the forward ascends), lazily constructed models work too, and training is unchanged
(fp32, 1e-5 relative against plain PyTorch: packing moves data, not arithmetic).
"""

import pathlib
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemini_helpers import reference_gpt_run, train_gemini  # noqa: E402

from colossal.gemini import GeminiDDP, GeminiOptimizer  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, random_batches  # noqa: E402

WIDTH = 16
LAYER = WIDTH * WIDTH + WIDTH  # elements of one Linear: one chunk each


class Reversed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _forward_chunks(example_inputs):
    torch.manual_seed(0)
    gem = GeminiDDP(Reversed(), device_memory_budget=1 << 20, chunk_size=LAYER, example_inputs=example_inputs)
    opt = GeminiOptimizer(torch.optim.SGD(gem.parameters(), lr=0.1), gem)
    x = torch.randn(3, WIDTH)
    opt.backward(gem(x).square().sum())
    opt.step()
    names = [c.tensors[0].name for c in gem.manager.chunks]
    return names, [op.chunk_ids for op in gem.trace.ops if op.label.startswith("fwd:")]


def test_layers_are_packed_in_run_order_and_unused_ones_last():
    names, fwd = _forward_chunks(example_inputs=torch.randn(1, WIDTH))
    assert names == ["layers.3.weight", "layers.2.weight", "layers.1.weight", "layers.0.weight", "unused.weight"]
    assert fwd == [(0,), (1,), (2,), (3,)]
    names, fwd = _forward_chunks(example_inputs=None)  # registration order
    assert names[0] == "layers.0.weight" and fwd == [(3,), (2,), (1,), (0,)]


def test_training_with_first_use_order_matches_plain_torch_also_when_lazy():
    batches = random_batches(2, batch=1, seq=8)
    init, ref_state, _ = reference_gpt_run(batches)
    gem, _ = train_gemini(batches, init, device_memory_budget=200_000, example_inputs=(batches[0][0],))
    state = gem.state_dict()
    for k, v in ref_state.items():
        assert_close(state[k], v)
    with torch.device("meta"):
        lazy = GPT(GPTConfig(init="torch"))
    gem = GeminiDDP(
        lazy,
        device_memory_budget=200_000,
        chunk_size=8192,
        example_inputs=(batches[0][0],),
        param_init_fn=lambda name, t: t.copy_(init[name]),
    )
    assert gem.state_dict().keys() == init.keys()
    torch.testing.assert_close(gem.state_dict()["blocks.1.mlp.fc_in.weight"], init["blocks.1.mlp.fc_in.weight"])


def test_bad_example_inputs_are_named():
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        GeminiDDP(Reversed(), device_memory_budget=1 << 20, example_inputs="x")
    with pytest.raises(ValueError, match="example_inputs: the forward pass on the meta device failed"):
        GeminiDDP(Reversed(), device_memory_budget=1 << 20, example_inputs=(torch.randn(2, WIDTH + 1),))
