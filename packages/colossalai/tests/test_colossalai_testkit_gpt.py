"""The component suites test on ``colossal.testkit.GPT`` (they may not import colossalai): it must
stay the same model as ``colossalai.models.GPT``: names, shapes, and outputs on the same weights."""

import pytest
import torch

import colossal.testkit as kit
from colossalai.models import GPT, GPTConfig


@pytest.mark.parametrize("sizes", [{}, dict(n_embd=48, n_head=6, n_layer=3, bias=False, tie_embeddings=False)])
def test_testkit_gpt_is_the_contract_gpt(sizes):
    ours = GPT(GPTConfig(**sizes)).eval()
    theirs = kit.GPT(kit.GPTConfig(**sizes)).eval()
    want = {n: p.shape for n, p in ours.named_parameters()}
    assert {n: p.shape for n, p in theirs.named_parameters()} == want
    theirs.load_state_dict(ours.state_dict(), strict=True)
    idx = torch.randint(0, 256, (2, 20))
    torch.testing.assert_close(theirs(idx), ours(idx), rtol=0, atol=0)
