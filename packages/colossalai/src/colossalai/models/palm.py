"""PaLM: a decoder-only transformer with parallel attention + MLP blocks (Chowdhery et al. 2022).

Reference: Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways" (2022), section 2
(model architecture), table 1 (sizes) and section 5 (training setup). What differs from the GPT of
:mod:`colossalai.models.gpt`:

- **SwiGLU MLP**: ``fc_out(swish(fc_gate(x)) * fc_in(x))`` with ``d_ff = 4 * d_model``.
- **Parallel block**: ``y = x + attn(ln(x)) + mlp(ln(x))`` with one shared LayerNorm.
- **Multi-query attention**: ``n_head`` query heads, one key head and one value head shared by all.
- **RoPE**: rotary position embeddings on queries and keys (no learned position table).
- **Shared input/output embedding**, pre-softmax logits scaled by ``1 / sqrt(d_model)``.
- **No biases** in any dense kernel or LayerNorm; no dropout.
- **z-loss**: ``1e-4 * log^2 Z`` keeps the softmax normaliser near 1. It is not added for you:
  ``loss = cross_entropy + model.aux_loss(logits, targets)`` (or :func:`palm_loss`).

Module names follow the GPT's contract where the roles match (``wte``, ``blocks``, ``ln_f``,
``lm_head``; attention ``q_proj``/``k_proj``/``v_proj``/``out_proj``; MLP ``fc_in``/``fc_out``, plus
``fc_gate``); each block has a single ``ln``. ``k_proj``/``v_proj`` are one head wide (MQA), so
a GPT tensor-parallel plan, which column-splits them, does not apply to this model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from colossalai.models.gpt import GPT
from colossalai.models.presets import LAZY_THRESHOLD

__all__ = [
    "PaLMConfig",
    "PaLM",
    "PaLMBlock",
    "MultiQueryAttention",
    "SwiGLU",
    "apply_rope",
    "rope_angles",
    "z_loss",
    "palm_loss",
    "PALM_PRESETS",
    "palm_config",
    "build_palm",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class PaLMConfig:
    """Shape of a :class:`PaLM` (defaults: the ``palm-tiny`` test model)."""

    vocab_size: int = 256
    """Number of token ids (256: byte-level text; the paper's presets use 256k SentencePiece ids)."""
    block_size: int = 64
    """Longest sequence the model is used with (the paper trains at 2048); RoPE itself has no limit."""
    n_embd: int = 32
    """Model width ``d_model``."""
    n_layer: int = 2
    """Number of parallel blocks."""
    n_head: int = 4
    """Query heads (keys and values have one head, shared: multi-query attention)."""
    head_dim: int = 8
    """Width of each head (256 in the paper, independent of ``d_model``); must be even (RoPE pairs)."""
    mlp_ratio: int = 4
    """``d_ff = mlp_ratio * d_model`` (4 in the paper)."""
    rope_base: float = 10_000.0
    """RoPE wavelength base: pair ``i`` of a head turns by ``pos * base^(-2i / head_dim)``."""
    z_loss_coef: float = 1e-4
    """Weight of ``log^2 Z`` in :meth:`PaLM.aux_loss` (1e-4 in the paper)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of storing them."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_embd", "n_layer", "n_head", "head_dim", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PaLMConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"PaLMConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.rope_base <= 1.0:
            raise ValueError(f"PaLMConfig.rope_base must exceed 1, got {self.rope_base}")
        if self.z_loss_coef < 0:
            raise ValueError(f"PaLMConfig.z_loss_coef must be >= 0, got {self.z_loss_coef}")

    @property
    def ffn_hidden(self) -> int:
        """``d_ff``, the SwiGLU hidden width."""
        return self.mlp_ratio * self.n_embd

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds (shared embedding counted once)."""
        d, q, hd, f = self.n_embd, self.n_head * self.head_dim, self.head_dim, self.ffn_hidden
        per_block = d + 2 * d * q + 2 * d * hd + 3 * d * f  # ln scale, q/out, k/v (one head), SwiGLU
        return self.vocab_size * d + self.n_layer * per_block + d


def rope_angles(t: int, head_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles ``pos * base^(-2i / head_dim)``, each (T, head_dim / 2), fp32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` (B, nh, T, hd) by the angles whose
    cos/sin are (T, hd/2) (Su et al., RoFormer, eq. 34)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, nh, T, hd/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # (B, nh, T, hd/2)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (B, nh, T, hd/2, 2)
    return rotated.flatten(-2).to(x.dtype)


class MultiQueryAttention(nn.Module):
    """Causal multi-query attention with RoPE: ``n_head`` query heads, one key/value head."""

    def __init__(self, config: PaLMConfig) -> None:
        super().__init__()
        d, hd = config.n_embd, config.head_dim
        self.head_dim = hd
        self.rope_base = config.rope_base
        self.q_proj = nn.Linear(d, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(d, hd, bias=False)
        self.v_proj = nn.Linear(d, hd, bias=False)
        self.out_proj = nn.Linear(config.n_head * hd, d, bias=False)
        self.sequence: tuple | None = None
        """``(group, kind)`` under sequence parallelism (``colossalai.policies.PaLMPolicy``): the input
        is this rank's chunk of the sequence, RoPE uses global positions and the attention is
        ``colossal.tensor_parallel`` ring (``kind="ring"``) or all-to-all attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C). Heads are read from ``q_proj``'s output width."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(b, t, 1, self.head_dim).transpose(1, 2)  # (B, 1, T, hd)
        v = self.v_proj(x).view(b, t, 1, self.head_dim).transpose(1, 2)  # (B, 1, T, hd)
        rank, ranks = (0, 1) if self.sequence is None else _group_rank_size(self.sequence[0])
        cos, sin = rope_angles(t * ranks, self.head_dim, self.rope_base, x.device)
        cos, sin = cos[rank * t : (rank + 1) * t], sin[rank * t : (rank + 1) * t]  # this chunk's positions
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        nh = q.shape[1]
        # The one K/V head serves every query head: expand is a view, its gradient sums over heads.
        k, v = k.expand(b, nh, t, -1), v.expand(b, nh, t, -1)
        if self.sequence is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            from colossal.tensor_parallel import all_to_all_attention, ring_attention

            attend = ring_attention if self.sequence[1] == "ring" else all_to_all_attention
            y = attend(q, k.contiguous(), v.contiguous(), self.sequence[0], causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)


def _group_rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


class SwiGLU(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``fc_out(silu(fc_gate(x)) * fc_in(x))``, no biases."""

    def __init__(self, config: PaLMConfig) -> None:
        super().__init__()
        self.fc_gate = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.fc_in = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.fc_out = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.fc_out(F.silu(self.fc_gate(x)) * self.fc_in(x))


class PaLMBlock(nn.Module):
    """Parallel block: ``x + attn(ln(x)) + mlp(ln(x))`` (one LayerNorm, no bias)."""

    def __init__(self, config: PaLMConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = MultiQueryAttention(config)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


def z_loss(logits: torch.Tensor, targets: torch.Tensor | None = None, *, ignore_index: int = -100) -> torch.Tensor:
    """Mean of ``log(Z)^2`` over positions, ``Z = sum(exp(logits))`` (PaLM section 5), in fp32.

    ``logits`` (..., V); positions whose ``targets`` equal ``ignore_index`` do not count.
    Unweighted: PaLM adds ``1e-4`` times this to the loss (:meth:`PaLM.aux_loss`)."""
    log_z = torch.logsumexp(logits.float(), dim=-1)  # (...)
    if targets is None:
        return log_z.square().mean()
    if targets.shape != log_z.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without V {tuple(log_z.shape)}")
    keep = targets != ignore_index
    return (log_z.square() * keep).sum() / keep.sum().clamp_min(1)


def palm_loss(
    logits: torch.Tensor, targets: torch.Tensor, *, z_loss_coef: float = 1e-4, ignore_index: int = -100
) -> torch.Tensor:
    """PaLM's training loss: next-token cross entropy + ``z_loss_coef * log^2 Z`` (fp32).

    ``logits`` (B, T, V), ``targets`` (B, T)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)
    return ce + z_loss_coef * z_loss(logits, targets, ignore_index=ignore_index)


class PaLM(nn.Module):
    """PaLM decoder: shared embedding, ``n_layer`` parallel blocks, final LayerNorm, tied LM head.

    ``forward`` returns logits (B, T, V) already scaled by ``1 / sqrt(d_model)``. Build on the meta
    device for large presets (``with torch.device("meta"): PaLM(cfg)``, or :func:`build_palm`),
    then :meth:`materialize` on the target device or let a sharding plugin do it.
    """

    def __init__(self, config: PaLMConfig) -> None:
        super().__init__()
        if not isinstance(config, PaLMConfig):
            raise TypeError(f"config must be a PaLMConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(PaLMBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Why a scale: the shared embedding is N(0, 1) (no LayerNorm after the input embedding), so
        # the output logits are scaled by 1/sqrt(d_model) to start near unit variance (section 5).
        self.logit_scale = config.n_embd**-0.5
        self.tie_weights()
        if not self.wte.weight.is_meta:
            self.init_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``wte.weight`` (PaLM always does)."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """PaLM initialisation (section 5): embedding N(0, 1), LayerNorm scales 1, every kernel
        "fan-in variance scaling" N(0, 1/fan_in)."""
        for name, p in self.named_parameters():
            if name == "wte.weight":
                p.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("ln.weight") or name == "ln_f.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=generator)

    # The same as the GPT's (they use only tie_weights, init_weights and config, which PaLM has).
    materialize = GPT.materialize
    set_activation_checkpointing = GPT.set_activation_checkpointing

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size={self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x)) * self.logit_scale  # (B, T, V)

    def aux_loss(self, logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``z_loss_coef * log^2 Z`` of ``logits`` (the model's output), to add to the task loss."""
        return self.config.z_loss_coef * z_loss(logits, targets)

    # Sampling is the GPT's (it only reads ``config.block_size`` and calls the model).
    generate = GPT.generate


PALM_PRESETS: dict[str, dict] = {
    "palm-tiny": dict(n_embd=32, n_layer=2, n_head=4, head_dim=8, block_size=64),  # ~38 K parameters; tests, CPU demos
    "palm-mini": dict(n_embd=128, n_layer=4, n_head=4, head_dim=32, block_size=128),  # ~1.0 M
    "palm-small": dict(n_embd=512, n_layer=12, n_head=8, head_dim=64, block_size=256),  # ~45 M
    # The paper's table 1: head dim 256, d_ff = 4 d_model, 256k vocabulary, sequence length 2048.
    "palm-8b": dict(n_embd=4096, n_layer=32, n_head=16, head_dim=256, vocab_size=256_000, block_size=2048),
    "palm-62b": dict(n_embd=8192, n_layer=64, n_head=32, head_dim=256, vocab_size=256_000, block_size=2048),
    "palm-540b": dict(n_embd=18432, n_layer=118, n_head=48, head_dim=256, vocab_size=256_000, block_size=2048),
}
"""Preset name -> :class:`PaLMConfig` fields. The paper's sizes count 8.63 B, 62.50 B and 540.35 B."""


def palm_config(preset: str = "palm-tiny", **overrides) -> PaLMConfig:
    """The :class:`PaLMConfig` of ``preset`` with ``overrides`` applied."""
    if preset not in PALM_PRESETS:
        raise ValueError(f"preset must be one of {sorted(PALM_PRESETS)}, got {preset!r}")
    fields = {f.name for f in dataclasses.fields(PaLMConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown PaLMConfig fields {sorted(unknown)}; expected some of {sorted(fields)}")
    return PaLMConfig(**{**PALM_PRESETS[preset], **overrides})


def build_palm(
    preset: str | PaLMConfig = "palm-tiny",
    *,
    device: torch.device | str | None = None,
    lazy: bool | None = None,
    seed: int | None = None,
    **overrides,
) -> PaLM:
    """Build a :class:`PaLM` from a preset name (or a config).

    ``lazy=True`` (default: when the model exceeds :data:`~colossalai.models.LAZY_THRESHOLD`
    parameters and no ``device`` is given) returns it on the meta device: nothing is allocated
    until :meth:`PaLM.materialize` or a plugin shards it. ``seed`` makes initialisation
    reproducible (on the CPU, then moved to ``device``).
    """
    if isinstance(preset, PaLMConfig) and overrides:
        raise ValueError(f"overrides {sorted(overrides)} apply to a preset name, not to a PaLMConfig")
    config = preset if isinstance(preset, PaLMConfig) else palm_config(preset, **overrides)
    if lazy is None:
        lazy = device is None and config.num_parameters() > LAZY_THRESHOLD
    with torch.device("meta"):
        model = PaLM(config)
    if lazy:
        return model
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return model.materialize("cpu", generator=gen).to(device or "cpu")
