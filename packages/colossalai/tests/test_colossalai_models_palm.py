"""PaLM (Chowdhery et al. 2022): parameter counts against the paper's table 1, RoPE / multi-query
attention / the parallel block / z-loss against references written here from the paper's
equations (complex-number RoPE, explicit per-head loops, float64), and parity of 3 training steps
under DDP, FSDP, ZeRO 1/2/3 and Gemini on 2 ranks with plain single-process PyTorch.

Parity tolerance: fp32, 1e-5 relative per-step loss (only the reduction order of the gradient sums
differs from the reference, as in test_colossalai_booster_*.py).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from colossalai_harness import GLOBAL_BATCH, LR, SEQ, dataset, mean_over_dp

from colossal.comm.testing import run_distributed
from colossalai import Booster, GeminiPlugin, TorchDDPPlugin, TorchFSDPPlugin, ZeroPlugin
from colossalai.data import ResumableDistributedSampler
from colossalai.models import (
    PALM_PRESETS,
    MultiQueryAttention,
    PaLMBlock,
    PaLMConfig,
    apply_rope,
    build_palm,
    palm_config,
    palm_loss,
    z_loss,
)
from colossalai.models.palm import rope_angles


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


# ---- the paper's table 1 -------------------------------------------------------------------------
PAPER = {"palm-8b": 8.63e9, "palm-62b": 62.50e9, "palm-540b": 540.35e9}


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_paper_presets_match_table_1_and_build_on_meta(preset):
    model = build_palm(preset)  # lazy by default: hundreds of billions of parameters, no memory
    assert all(p.is_meta for p in model.parameters())
    counted = sum(p.numel() for p in model.parameters())  # the tied LM head is counted once
    assert counted == palm_config(preset).num_parameters()
    assert abs(counted - PAPER[preset]) / PAPER[preset] < 0.02, f"{preset}: {counted:,} vs {PAPER[preset]:,.0f}"
    cfg = palm_config(preset)
    assert (cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size) == (256, 4 * cfg.n_embd, 256_000)
    assert model.blocks[0].attn.k_proj.weight.shape == (256, cfg.n_embd)  # one key head (MQA)


@pytest.mark.parametrize("preset", ["palm-tiny", "palm-mini"])
def test_small_presets_count_and_have_no_biases(preset):
    model = build_palm(preset, seed=0)
    assert sum(p.numel() for p in model.parameters()) == palm_config(preset).num_parameters()
    assert not [n for n, _ in model.named_parameters() if "bias" in n]
    assert model.lm_head.weight is model.wte.weight
    assert set(PALM_PRESETS) >= {"palm-tiny", "palm-8b", "palm-62b", "palm-540b"}


def test_initialisation_follows_section_5():
    model = build_palm("palm-mini", seed=0)
    assert abs(model.wte.weight.std().item() - 1.0) < 0.02  # embedding N(0, 1)
    w = model.blocks[0].mlp.fc_out.weight  # fan-in = d_ff
    assert abs(w.std().item() * math.sqrt(w.shape[1]) - 1.0) < 0.02
    assert torch.equal(model.blocks[0].ln.weight, torch.ones(128))


# ---- references from the equations ---------------------------------------------------------------
def _rope_reference(x, base):
    """RoPE as complex multiplication: z_i = x_{2i} + j x_{2i+1} at position m becomes
    z_i * exp(j m theta_i), theta_i = base^(-2i/d) (RoFormer eq. 34), in float64."""
    d, t = x.shape[-1], x.shape[-2]
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())  # (..., T, d/2)
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    m = torch.arange(t, dtype=torch.float64)[:, None]
    return torch.view_as_real(z * torch.polar(torch.ones_like(m * theta), m * theta)).reshape(x.shape)


def _attention_reference(x, attn, base):
    """Multi-query attention head by head: every query head h uses the one shared K and V."""
    x = x.double()
    b, t, _ = x.shape
    hd = attn.head_dim
    wq, wk, wv, wo = (p.weight.double() for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj))
    k = _rope_reference((x @ wk.T)[:, None], base)[:, 0]  # (B, T, hd): one key head
    v = x @ wv.T  # (B, T, hd): one value head
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    heads = []
    for h in range(wq.shape[0] // hd):
        q = _rope_reference((x @ wq[h * hd : (h + 1) * hd].T)[:, None], base)[:, 0]  # (B, T, hd)
        scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ wo.T


def _layer_norm_reference(x, gain, eps=1e-5):
    x = x.double()
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * gain.double()


def test_rope_equals_complex_rotation_and_is_relative():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 10, 16, generator=gen)
    cos, sin = rope_angles(10, 16, 10_000.0)
    got = apply_rope(x, cos, sin)
    assert _rel(got, _rope_reference(x, 10_000.0)) < 1e-6
    # <rope(q, m), rope(k, n)> depends on m - n only: shift both positions by 3.
    q, k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    seq_q, seq_k = q.expand(1, 1, 10, 16), k.expand(1, 1, 10, 16)
    rq, rk = apply_rope(seq_q, cos, sin)[0, 0], apply_rope(seq_k, cos, sin)[0, 0]
    assert abs((rq[5] @ rk[2]) - (rq[8] @ rk[5])) < 1e-4
    assert abs((rq[5] @ rk[2]) - (rq[5] @ rk[3])) > 1e-3  # and it does depend on the offset


def test_multi_query_attention_equals_per_head_loop():
    cfg = PaLMConfig(n_embd=24, n_head=3, head_dim=8, rope_base=500.0)
    torch.manual_seed(0)
    attn = MultiQueryAttention(cfg)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (8, 24)
    x = torch.randn(2, 12, 24, requires_grad=True)
    got = attn(x)
    want = _attention_reference(x, attn, 500.0)
    assert _rel(got, want) < 1e-5
    got.square().sum().backward()
    k_grad = attn.k_proj.weight.grad.clone()
    ref_x = x.detach().double().requires_grad_(True)
    _attention_reference(ref_x, attn, 500.0).square().sum().backward()
    assert _rel(x.grad, ref_x.grad) < 1e-5
    assert k_grad.norm() > 0


def test_parallel_block_equals_paper_equation():
    """y = x + attn(LN(x)) + W2(swish(LN(x) W1) * LN(x) V), one LayerNorm without bias."""
    cfg = PaLMConfig(n_embd=32, n_head=4, head_dim=8)
    torch.manual_seed(1)
    block = PaLMBlock(cfg)
    with torch.no_grad():
        block.ln.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 32)
    h = _layer_norm_reference(x, block.ln.weight)
    gate, up, down = (m.weight.double() for m in (block.mlp.fc_gate, block.mlp.fc_in, block.mlp.fc_out))
    a = h @ gate.T
    mlp = (a * torch.sigmoid(a) * (h @ up.T)) @ down.T  # swish(x) = x * sigmoid(x)
    want = x.double() + _attention_reference(h, block.attn, cfg.rope_base) + mlp
    assert _rel(block(x), want) < 1e-5


def test_model_logits_use_the_shared_embedding_scaled():
    model = build_palm("palm-tiny", seed=0, n_layer=1)
    idx = torch.randint(0, 256, (2, 7))
    x = model.blocks[0](model.wte.weight[idx])  # input embedding: no position table, no scaling
    want = _layer_norm_reference(x, model.ln_f.weight) @ model.wte.weight.double().T / math.sqrt(32)
    assert _rel(model(idx), want) < 1e-5


def test_z_loss_and_palm_loss_from_the_definition():
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    targets[0, :2] = -100
    keep = targets != -100
    log_z = logits.double().exp().sum(-1).log()
    want = (log_z[keep] ** 2).mean()
    assert abs(z_loss(logits, targets).item() - want.item()) < 1e-5 * want.item()
    assert abs(z_loss(logits).item() - (log_z**2).mean().item()) < 1e-5 * want.item()
    ce = F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())
    loss = palm_loss(logits, targets)
    assert abs(loss.item() - (ce + 1e-4 * want).item()) < 1e-6
    model = build_palm("palm-tiny", seed=0)
    out = model(targets.clamp_min(0))
    assert torch.equal(model.aux_loss(out, targets), 1e-4 * z_loss(out, targets))
    loss.backward()  # the z-term pulls log Z towards 0: its gradient is 2e-4 log Z softmax
    z_grad = torch.autograd.grad(1e-4 * z_loss(logits, targets), logits)[0]
    expected = 2e-4 * log_z[..., None] * torch.softmax(logits.double(), -1) * keep[..., None] / keep.sum()
    assert _rel(z_grad, expected) < 1e-5
    with pytest.raises(ValueError, match="targets shape"):
        z_loss(logits, targets[:, :3])


def test_activation_checkpointing_and_generate():
    model = build_palm("palm-tiny", seed=0)
    idx = torch.randint(0, 256, (2, 16))
    palm_loss(model(idx), idx).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_activation_checkpointing(True)
    palm_loss(model(idx), idx).backward()
    assert all(_rel(p.grad, g) < 1e-6 for p, g in zip(model.parameters(), grads, strict=True))
    out = model.generate(idx[:, :4], 5, temperature=0)
    assert out.shape == (2, 9) and torch.equal(out[:, :4], idx[:, :4])


def test_config_errors():
    with pytest.raises(ValueError, match="head_dim must be even"):
        PaLMConfig(head_dim=7)
    with pytest.raises(ValueError, match="n_head must be a positive int"):
        palm_config("palm-tiny", n_head=0)
    with pytest.raises(ValueError, match="unknown PaLMConfig fields"):
        palm_config("palm-tiny", bias=True)
    with pytest.raises(ValueError, match="preset must be one of"):
        build_palm("palm-1t")
    with pytest.raises(ValueError, match="exceeds block_size"):
        build_palm("palm-tiny", seed=0)(torch.zeros(1, 65, dtype=torch.long))


# ---- every plugin trains PaLM like one process ---------------------------------------------------
STEPS = 3
PLUGINS = [
    ("ddp", {}),
    ("fsdp", {}),
    ("zero", dict(stage=1)),
    ("zero", dict(stage=2)),
    ("zero", dict(stage=3)),
    ("gemini", dict(placement="auto", device_memory_budget=4 << 20)),
]
_MAKE = {"ddp": TorchDDPPlugin, "fsdp": TorchFSDPPlugin, "zero": ZeroPlugin, "gemini": GeminiPlugin}


def _make_model_and_optim(lazy: bool = False):
    model = build_palm("palm-tiny", seed=0, lazy=lazy, block_size=SEQ)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _reference_losses(steps: int) -> list[float]:
    torch.manual_seed(0)
    model, optim = _make_model_and_optim()
    sampler = ResumableDistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)
    losses = []
    for (x, y), _ in zip(loader, range(steps)):
        loss = palm_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _boosted_losses(booster, model, optim, loader) -> list[float]:
    losses = []
    for (x, y), _ in zip(loader, range(STEPS)):
        loss = palm_loss(model(x.to(booster.plugin.device)), y.to(booster.plugin.device))
        booster.backward(loss, optim)
        optim.step()
        optim.zero_grad()
        losses.append(mean_over_dp(loss, booster))
    return losses


def _plugin_losses(plugins):
    out = []
    for name, kwargs in plugins:
        torch.manual_seed(0)
        plugin = _MAKE[name](**kwargs)
        booster = Booster(plugin=plugin)
        model, optim = _make_model_and_optim(lazy=kwargs.get("stage") == 3)
        loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
        model, optim, _, loader, _ = booster.boost(model, optim, palm_loss, loader)
        out.append(_boosted_losses(booster, model, optim, loader))
    return out


def test_every_plugin_trains_palm_like_plain_pytorch_on_two_ranks():
    ref = torch.tensor(_reference_losses(STEPS))
    got = run_distributed(_plugin_losses, 2, PLUGINS, timeout=300)[0]
    for (name, kwargs), losses in zip(PLUGINS, got, strict=True):
        label = f"{name} {kwargs}"
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-5, atol=0, msg=lambda m, c=label: f"{c}: {m}")


# ---- colossalai train --model palm ---------------------------------------------------------------
def test_cli_options_for_palm():
    from colossalai.cli import validate
    from colossalai.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "--model", "palm"])
    validate.validate_train(args)  # the default preset becomes palm-mini
    for argv, message in (
        (["--preset", "tiny"], "--preset tiny is not a --model palm preset"),
        (
            ["--plugin", "hybrid", "--nproc", "4", "--tp-size", "4", "--tp-mode", "2d"],
            "--model palm splits with --tp-mode 1d only",
        ),
        (["--plugin", "hybrid", "--nproc", "2", "--preset", "palm-tiny", "--tp-size", "2", "--seq-len", "32"], None),
    ):
        if message is None:  # the hybrid plugin has PaLM's policy (colossalai.policies.PaLMPolicy)
            validate.validate_train(parser.parse_args(["train", "--model", "palm", *argv]))
            continue
        with pytest.raises(validate.UsageError, match=message):
            validate.validate_train(parser.parse_args(["train", "--model", "palm", *argv]))
    with pytest.raises(validate.UsageError, match="--preset palm-tiny is not a --model gpt preset"):
        validate.validate_train(parser.parse_args(["train", "--preset", "palm-tiny"]))


def _cli(*argv) -> str:
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "colossalai.cli", *argv], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_cli_trains_palm_tiny_and_resumes_it_under_zero_3(tmp_path):
    """``colossalai train --model palm``: the loss falls; resuming the step-3 checkpoint under
    ZeRO-3 on 2 processes repeats steps 4-6 of the uninterrupted single-process run."""
    import re

    from colossalai.cli.train_args import VOCAB_SIZE

    argv = ["train", "--model", "palm", "--preset", "palm-tiny", "--plugin", "ddp", "--steps", "6", "--seq-len", "32"]
    argv += ["--batch-size", "8", "--warmup", "2"]
    argv += ["--corpus-bytes", "100000", "--progress", "plain", "--log-every", "1", "--sample-tokens", "8"]
    out = _cli(*argv, "--save-every", "3", "--save-dir", str(tmp_path))
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/\d+ loss ([0-9.]+)", out)}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]
    config = palm_config("palm-tiny", vocab_size=VOCAB_SIZE)  # the CLI's vocabulary: the BPE it learns
    assert f"PaLM palm-tiny: {config.num_parameters():,} parameters" in out
    resumed = _cli(*argv, "--resume", str(tmp_path / "step-00000003"), "--nproc", "2", "--plugin", "zero",
                   "--zero-stage", "3")  # fmt: skip
    again = {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/\d+ loss ([0-9.]+)", resumed)}
    assert sorted(again) == [4, 5, 6]
    for step, loss in again.items():  # the log prints 6 decimals: ~2e-7 relative
        assert abs(loss - losses[step]) <= 1e-5 * losses[step], (step, loss, losses[step])
