"""A GPT language model that reads top to bottom (after nanoGPT).

References: Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2, 2019);
Karpathy, nanoGPT (github.com/karpathy/nanoGPT). Module names follow the cross-package contract
(``wte``, ``wpe``, ``blocks``, ``ln_f``, ``lm_head``; attention ``q_proj``/``k_proj``/``v_proj``/
``out_proj``; MLP ``fc_in``/``fc_out``) so that tensor-parallel plans and checkpoints of other
packages can name parameters without importing this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "sample_tokens"]


@dataclasses.dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 256
    """Number of token ids (256: byte-level text)."""
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
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of storing them."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must lie in [0, 1), got {self.dropout}")

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds (tied embedding counted once)."""
        c, v, t, b = self.n_embd, self.vocab_size, self.block_size, int(self.bias)
        per_block = 4 * (c * c + b * c) + (4 * c * c + 4 * c * b) + (4 * c * c + c * b) + 2 * (c + b * c)
        head = 0 if self.tie_embeddings else v * c
        return v * c + t * c + self.n_layer * per_block + (c + b * c) + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.n_head = config.n_head  # heads of this module (a tensor-parallel conversion may lower it)
        self.head_dim = c // config.n_head
        self.q_proj = nn.Linear(c, c, bias=config.bias)
        self.k_proj = nn.Linear(c, c, bias=config.bias)
        self.v_proj = nn.Linear(c, c, bias=config.bias)
        self.out_proj = nn.Linear(c, c, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        self.is_causal = True  # read by sequence-parallel attention, which keeps the mask it is told
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C).

        The number of heads is read from the projections' output width, so a column-sharded
        (tensor-parallel) ``q/k/v_proj`` holding fewer heads runs unchanged.
        """
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        # q, k, v: (B, nh, T, hs)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # (B, nh, T, hs)
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


def _scratch_device(model: nn.Module, generator: torch.Generator | None) -> torch.device:
    """Where :func:`normal_or_skip_` draws a meta parameter's numbers: the generator's device, else
    that of the model's real parameters (whose default random stream a dense build would use)."""
    if generator is not None:
        return generator.device
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def normal_or_skip_(p: torch.Tensor, std: float, generator: torch.Generator | None, scratch_device) -> None:
    """``p.normal_(0, std)``; a meta ``p`` (another pipeline stage's) is drawn into a scratch
    tensor that is dropped at once, so the random stream advances as in a dense build."""
    target = torch.empty(p.shape, dtype=p.dtype, device=scratch_device) if p.is_meta else p
    target.normal_(0.0, std, generator=generator)


class GPT(nn.Module):
    """Decoder-only transformer: token + position embedding, ``n_layer`` blocks, final LayerNorm, LM head.

    Build on the meta device for models too large to initialise eagerly
    (``with torch.device("meta"): GPT(cfg)``), then :meth:`materialize` on the target device.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        if not self.wte.weight.is_meta:
            self.init_weights()

    def tie_weights(self) -> None:
        """Point ``lm_head.weight`` at ``wte.weight`` when the config ties embeddings."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm gains, and
        residual output projections scaled by 1/sqrt(2 * n_layer).

        A parameter still on the meta device (another pipeline stage's) is drawn into a scratch
        tensor and dropped, so the parameters that are real get the values of a dense build from
        the same random state (``[Note: same initial values as a dense build]`` in
        ``colossal.pipeline.stages``)."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        scratch_device = _scratch_device(self, generator)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("out_proj.weight", "fc_out.weight")) else 0.02
                normal_or_skip_(p, std, generator, scratch_device)

    def materialize(self, device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> GPT:
        """Allocate meta parameters on ``device`` and initialise them; returns ``self``."""
        self.to_empty(device=device)
        self.tie_weights()
        self.init_weights(generator)
        return self

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Switch activation checkpointing (recompute each block in backward) on or off."""
        self.config.activation_checkpointing = bool(enabled)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T0); returns (B, T0 + max_new_tokens).

        ``temperature`` 0 means greedy decoding; ``top_k`` keeps only the k likeliest tokens.
        ``forward`` (ids (B, T) -> logits (B, T, V)) replaces ``self``, e.g. a distributed wrapper
        of this model that returns full logits; with the same ``generator`` seed on every rank,
        every rank then samples the same tokens.
        """
        return sample_tokens(
            forward or self, idx, max_new_tokens, self.config.block_size,
            temperature=temperature, top_k=top_k, generator=generator,
        )  # fmt: skip


def sample_tokens(
    forward: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx`` (B, T0) from ``forward`` (ids (B, T) ->
    logits (B, T, V), T at most ``block_size``); returns (B, T0 + max_new_tokens). See
    :meth:`GPT.generate` (which calls it) for ``temperature``, ``top_k`` and ``generator``."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    for _ in range(max_new_tokens):
        window = idx[:, -block_size:]  # (B, <=T)
        logits = forward(window)[:, -1, :].float()  # (B, V)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            if generator is not None:  # sample where the generator lives (e.g. a CPU one for a CUDA model)
                probs = probs.to(generator.device)
            nxt = torch.multinomial(probs, 1, generator=generator).to(idx.device)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
