"""The GPT: contract names, parameter counts, meta construction, activation checkpointing, sampling."""

import pytest
import torch

from colossalai.models import PRESETS, GPTConfig, build_gpt, gpt_config


def test_contract_module_names_and_shapes():
    model = build_gpt(GPTConfig(), seed=0)
    names = dict(model.named_parameters())
    for name in ["wte.weight", "wpe.weight", "blocks.0.attn.q_proj.weight", "blocks.1.mlp.fc_out.bias", "ln_f.weight"]:
        assert name in names, name
    assert model.lm_head.weight is model.wte.weight
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_build_lazily_with_exact_parameter_count(preset):
    model = build_gpt(preset, lazy=True)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == gpt_config(preset).num_parameters()


def test_big_presets_default_to_meta():
    assert next(build_gpt("1.3b").parameters()).is_meta
    assert not next(build_gpt("tiny").parameters()).is_meta


def test_materialize_matches_eager_seeded_init():
    eager = build_gpt("tiny", seed=3)
    lazy = build_gpt("tiny", lazy=True).materialize("cpu", generator=torch.Generator().manual_seed(3))
    for (n, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert lazy.lm_head.weight is lazy.wte.weight


def test_attention_is_causal_against_manual_reference():
    model = build_gpt("tiny", seed=0).double()
    x = torch.randint(0, 256, (2, 9))
    attn, h = model.blocks[0].attn, model.blocks[0].ln_1(model.wte(x) + model.wpe(torch.arange(9)))
    b, t, c = h.shape
    q, k, v = (p(h).view(b, t, 4, c // 4).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    scores = (q @ k.transpose(-1, -2)) / (c // 4) ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    ref = attn.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))
    torch.testing.assert_close(attn(h), ref, rtol=1e-10, atol=1e-10)


def test_activation_checkpointing_gives_identical_gradients():
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for ac in (False, True):
        model = build_gpt("tiny", seed=0)
        model.set_activation_checkpointing(ac)
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_generate_shapes_greedy_determinism_and_block_size_crop():
    model = build_gpt("tiny", seed=0, block_size=8)
    prompt = torch.randint(0, 256, (2, 5))
    out = model.generate(prompt, 12, temperature=0)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, 12, temperature=0))
    sampled = model.generate(prompt, 4, top_k=3, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 9)


def test_bad_config_and_input_raise_clear_errors():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="preset"):
        gpt_config("huge")
    with pytest.raises(ValueError, match="block_size"):
        build_gpt("tiny", seed=0)(torch.zeros(1, 65, dtype=torch.long))
