"""The small nanoGPT-like model of CONTRACTS.md (copied: tests cannot import colossalai)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Sizes of the test GPT."""

    vocab_size: int = 64
    """Tokens."""
    block_size: int = 16
    """Maximum sequence length."""
    n_embd: int = 16
    """Hidden size."""
    n_layer: int = 2
    """Blocks."""
    n_head: int = 2
    """Attention heads."""
    dropout: float = 0.0
    """Dropout probability."""
    bias: bool = True
    """Biases in Linear/LayerNorm."""
    tie_embeddings: bool = True
    """lm_head.weight is wte.weight."""


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(c.n_embd, c.n_embd, bias=c.bias) for _ in range(4)
        )
        self.resid_drop = nn.Dropout(c.dropout)

    def forward(self, x):
        B, T, C = x.shape
        heads = (B, T, self.n_head, C // self.n_head)
        q, k, v = (p(x).view(heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.resid_drop(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.fc_out = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.drop(self.fc_out(F.gelu(self.fc_in(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd, bias=c.bias), CausalSelfAttention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.n_embd, bias=c.bias), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("out_proj.weight") or n.endswith("fc_out.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)
