"""The small GPT of the cross-package contract, for tests (after nanoGPT).

References: Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2, 2019);
Karpathy, nanoGPT. Module and parameter names are those of ``colossalai.models.GPT`` (``wte``,
``wpe``, ``blocks.*.{ln_1, attn, ln_2, mlp}``, ``ln_f``, ``lm_head``; attention ``q_proj``/
``k_proj``/``v_proj``/``out_proj``; MLP ``fc_in``/``fc_out``), so that tensor-parallel plans,
engines and checkpoints are tested on the model users train, without the tests of a component
importing the meta-package. The attention reads its head count from ``n_head`` and the head size
from the projection's width (``view(B, T, n_head, -1)``), so a head-split projection runs
unchanged once ``n_head`` is divided by the number of head shards. One difference: dropout acts
on the attention output, not on the attention probabilities (which would need the tensor-parallel
RNG inside ``scaled_dot_product_attention``); with ``dropout=0`` the two models agree exactly
(``packages/colossalai/tests/test_colossalai_testkit_gpt.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "randomize_biases_"]


@dataclasses.dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a test :class:`GPT` (defaults: the ``tiny`` preset, about 35 K parameters)."""

    vocab_size: int = 256
    """Number of token ids."""
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    n_embd: int = 32
    """Hidden width C."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide ``n_embd``."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention output and MLP output."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""
    tie_embeddings: bool = True
    """Share ``lm_head.weight`` with ``wte.weight``."""
    init: str = "gpt2"
    """Initialisation of a :class:`GPT`: ``"gpt2"`` (nanoGPT's, as ``colossalai.models.GPT``:
    N(0, 0.02) weights, zero biases) or ``"torch"`` (every module's PyTorch default: N(0, 1)
    embeddings and uniform Linear weights and biases, whose larger norms keep the fp32 summation
    noise that Adam magnifies on near-zero-gradient elements far below 1e-5 of each tensor)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}")
        if self.init not in ("gpt2", "torch"):
            raise ValueError(f"GPTConfig.init must be 'gpt2' or 'torch', got {self.init!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.q_proj = nn.Linear(c, c, bias=config.bias)
        self.k_proj = nn.Linear(c, c, bias=config.bias)
        self.v_proj = nn.Linear(c, c, bias=config.bias)
        self.out_proj = nn.Linear(c, c, bias=config.bias)
        self.n_head = config.n_head  # heads of this module (a tensor-parallel conversion divides it)
        self.resid_drop = nn.Dropout(config.dropout)
        self.is_causal = True  # read by sequence-parallel attention, which keeps the mask it is told

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, nh * hs)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU(tanh) -> Linear(4C, C) -> Dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.fc_out = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.drop(self.fc_out(F.gelu(self.fc_in(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _init_module(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class GPT(nn.Module):
    """Decoder-only transformer: token + position embedding, ``n_layer`` blocks, final LayerNorm,
    LM head. Built under ``torch.device("meta")`` it allocates nothing (engines that materialise
    lazily are tested that way); otherwise it is initialised at once as ``config.init`` says, from
    the global RNG (seed with ``torch.manual_seed`` for reproducible weights)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if config.init == "gpt2" and not self.wte.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation, in nanoGPT's order: per module N(0, 0.02) Linear and Embedding
        weights and zero Linear biases (LayerNorms keep ones and zeros), then the residual output
        projections re-drawn with std 0.02 / sqrt(2 * n_layer)."""
        self.apply(_init_module)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "fc_out.weight")):
                nn.init.normal_(p, 0.0, resid_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


@torch.no_grad()
def randomize_biases_(module: nn.Module, std: float = 0.02) -> nn.Module:
    """Draw every bias of ``module`` from N(0, ``std``) in place and return ``module``. GPT-2
    initialisation zeroes the biases, which would hide a parallel layer that drops, repeats or
    misplaces a bias from a forward-parity test."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, std)
    return module
