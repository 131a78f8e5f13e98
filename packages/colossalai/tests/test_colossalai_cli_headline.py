"""The capacity figures of ``colossalai train``: model-state bytes per process and the default
Gemini device budget (``colossalai.cli.headline``)."""

import pytest
import torch

from colossalai.cli import headline
from colossalai.models import build_gpt


def _adam_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters, gradients and AdamW's moments after one real step (the reference)."""
    optim = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optim.step()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [t for s in optim.state.values() for t in s.values() if t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_fp32_model_states_equal_what_torch_allocates():
    model = build_gpt("tiny", seed=0)
    n = model.config.num_parameters()
    assert headline.model_state_bytes(n, "fp32") == _adam_state_bytes(model)
    assert headline.model_state_bytes(n, "fp32", shards=2) == _adam_state_bytes(model) // 2


def test_mixed_precision_adds_the_fp32_master():
    assert headline.model_state_bytes(1000, "bf16") == 1000 * (2 + 2 + 4 + 8)
    assert headline.model_state_bytes(1000, "fp16") == headline.model_state_bytes(1000, "bf16")


def test_default_budget_is_smaller_than_the_states():
    n = build_gpt("mini", seed=0).config.num_parameters()
    states = headline.model_state_bytes(n, "fp32")
    budget = headline.default_device_budget(n, "fp32")
    assert budget == int(states * headline.DEFAULT_BUDGET_FRACTION) and budget < states
    assert "= 1.5 x the device budget" in headline.headline(states, budget, "cpu")


@pytest.mark.parametrize(("precision", "shards"), [("fp8", 1), ("fp32", 0)])
def test_bad_arguments(precision, shards):
    with pytest.raises(ValueError, match="precision|shards"):
        headline.model_state_bytes(10, precision, shards)
