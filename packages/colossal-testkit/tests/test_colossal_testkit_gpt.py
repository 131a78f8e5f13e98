"""The test GPT matches the contract: names, parameter count, causality, a head-split attention."""

import pytest
import torch

from colossal.testkit import GPT, CausalSelfAttention, GPTConfig, randomize_biases_


def test_names_and_tied_head():
    model = GPT(GPTConfig())
    names = dict(model.named_parameters())
    assert "blocks.1.attn.q_proj.weight" in names and "blocks.0.mlp.fc_out.bias" in names
    assert "lm_head.weight" not in names  # tied to wte.weight (deduplicated)
    assert model.lm_head.weight is model.wte.weight
    c, v, t, per_block = 32, 256, 64, 12 * 32 * 32 + 13 * 32
    assert sum(p.numel() for p in model.parameters()) == v * c + t * c + 2 * per_block + 2 * c


def test_causal_and_seeded():
    torch.manual_seed(0)
    a = GPT(GPTConfig())
    torch.manual_seed(0)
    b = GPT(GPTConfig())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    x = torch.randint(0, 256, (2, 10))
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 256
    assert torch.allclose(a(x)[:, :6], a(y)[:, :6]) and not torch.allclose(a(x)[:, 6:], a(y)[:, 6:])


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    assert all(p.is_meta for p in model.parameters())


def test_head_split_attention_runs_on_its_heads():
    """A projection holding half the heads (as tensor parallelism leaves it) runs once n_head is halved."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(GPTConfig(n_embd=16, n_head=4))
    x = torch.randn(2, 5, 16)
    full = attn(x)
    half = CausalSelfAttention(GPTConfig(n_embd=16, n_head=4))
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            dense, local = getattr(attn, name), getattr(half, name)
            local.weight = torch.nn.Parameter(dense.weight[:8].clone())
            local.bias = torch.nn.Parameter(dense.bias[:8].clone())
        half.out_proj.weight = torch.nn.Parameter(attn.out_proj.weight[:, :8].clone())
        half.out_proj.bias = torch.nn.Parameter(torch.zeros(16))
    half.n_head = 2
    other = attn.out_proj.weight[:, 8:] @ _heads_output(attn, x)[..., 8:].unsqueeze(-1)
    assert torch.allclose(half(x) + other.squeeze(-1) + attn.out_proj.bias, full, atol=1e-6)


def _heads_output(attn, x):
    """The attention output before out_proj, (B, T, C)."""
    captured = {}
    handle = attn.out_proj.register_forward_hook(lambda m, inp, out: captured.setdefault("y", inp[0]))
    attn(x)
    handle.remove()
    return captured["y"]


@pytest.mark.parametrize("bad", [dict(n_head=3), dict(n_layer=0)])
def test_bad_config_is_a_value_error(bad):
    with pytest.raises(ValueError, match="GPTConfig"):
        GPTConfig(**bad)


def test_randomize_biases_makes_every_bias_nonzero():
    model = GPT(GPTConfig())
    assert all(not p.any() for n, p in model.named_parameters() if n.endswith("bias"))  # GPT-2 init
    assert randomize_biases_(model) is model
    assert all(p.abs().min() > 0 for n, p in model.named_parameters() if n.endswith("bias"))


def test_torch_init_keeps_the_module_defaults():
    torch.manual_seed(0)
    model = GPT(GPTConfig(init="torch"))
    torch.manual_seed(0)
    wte = torch.nn.Embedding(256, 32)  # the first module built, with PyTorch's default N(0, 1)
    assert torch.equal(model.wte.weight, wte.weight)
    assert model.blocks[0].attn.q_proj.bias.abs().min() > 0
    with pytest.raises(ValueError, match="init"):
        GPTConfig(init="xavier")
