"""A mixture-of-experts GPT: the GPT of :mod:`colossalai.models.gpt` with every k-th block's MLP
replaced by a :class:`colossal.moe.MoE` layer (Switch Transformer: every other feed-forward).

References: Fedus, Zoph, Shazeer, "Switch Transformers" (2021); Lepikhin et al., "GShard"
(2020); Zoph et al., "ST-MoE" (2022). The blocks, attention and embeddings are the GPT's own
(nothing is copied); only ``blocks[i].mlp`` changes type, so parameter names stay those of the
dense GPT plus ``blocks.<i>.mlp.router.gate.weight`` and ``blocks.<i>.mlp.experts.<w_in|b_in|w_out|b_out>``
(stacked over experts).

The auxiliary losses are not added for you: after each forward, :meth:`MoEGPT.aux_loss` returns
the sum over MoE layers of ``aux_loss_coef * load_balancing + z_loss_coef * z_loss``; add it to
the task loss (``loss = cross_entropy + model.aux_loss()``). :meth:`MoEGPT.moe_stats` gives
each layer's dropped tokens and expert load.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed import ProcessGroup

from colossal.moe import MoE, MoEConfig, MoEStats, moe_aux_loss, moe_layers
from colossalai.models.gpt import GPT, GPTConfig

__all__ = ["MoEGPTConfig", "MoEGPT", "MOE_PRESETS", "moe_gpt_config", "build_moe_gpt"]


@dataclasses.dataclass(kw_only=True, slots=True)
class MoEGPTConfig(GPTConfig):
    """Shape of a :class:`MoEGPT`: a :class:`GPTConfig` plus the MoE layers'."""

    num_experts: int = 4
    """Experts per MoE layer (over all expert-parallel ranks)."""
    moe_every: int = 2
    """Every ``moe_every``-th block is an MoE block (blocks ``moe_every - 1``, ``2 * moe_every - 1``, ...);
    1 makes every block sparse, 2 is Switch's every other feed-forward."""
    top_k: int = 1
    """Experts per token (1: Switch, 2: GShard / Mixtral)."""
    capacity_factor: float | None = 1.25
    """Expert capacity factor (Switch trains with 1.25); ``None`` is dropless."""
    expert: str = "mlp"
    """``"mlp"`` (the GPT's GELU MLP, width 4C) or ``"swiglu"``."""
    router_jitter: float = 0.0
    """Switch's multiplicative jitter on the router input during training."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in :meth:`MoEGPT.aux_loss`."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss in :meth:`MoEGPT.aux_loss`."""

    def __post_init__(self) -> None:
        GPTConfig.__post_init__(self)
        if not isinstance(self.moe_every, int) or self.moe_every < 1:
            raise ValueError(f"MoEGPTConfig.moe_every must be a positive int, got {self.moe_every!r}")
        if self.moe_every > self.n_layer:
            raise ValueError(f"MoEGPTConfig.moe_every={self.moe_every} exceeds n_layer={self.n_layer}: no MoE block")
        self.moe_config()  # validates experts, top_k, capacity_factor

    def moe_config(self) -> MoEConfig:
        """The :class:`MoEConfig` of every MoE block."""
        return MoEConfig(
            hidden=self.n_embd,
            ffn_hidden=4 * self.n_embd,
            num_experts=self.num_experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            jitter=self.router_jitter,
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
            expert=self.expert,
            activation="gelu_tanh",
            bias=self.bias,
        )

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) holds an MoE layer."""
        return (index + 1) % self.moe_every == 0

    def num_parameters(self) -> int:
        """Parameter count over all experts (tied embedding counted once)."""
        c, b, e = self.n_embd, int(self.bias), self.num_experts
        dense_mlp = 8 * c * c + 4 * c * b + c * b
        expert = 12 * c * c if self.expert == "swiglu" else dense_mlp
        n_moe = sum(self.is_moe_block(i) for i in range(self.n_layer))
        return GPTConfig.num_parameters(self) + n_moe * (e * expert + c * e - dense_mlp)

    def num_active_parameters(self) -> int:
        """Parameters one token passes through (``top_k`` experts per MoE block)."""
        dense = GPTConfig.num_parameters(self)
        c, b, k = self.n_embd, int(self.bias), self.top_k
        dense_mlp = 8 * c * c + 4 * c * b + c * b
        expert = 12 * c * c if self.expert == "swiglu" else dense_mlp
        n_moe = sum(self.is_moe_block(i) for i in range(self.n_layer))
        return dense + n_moe * (k * expert + c * self.num_experts - dense_mlp)


class MoEGPT(GPT):
    """The GPT with MoE blocks; ``ep_group`` splits every MoE layer's experts over its ranks."""

    def __init__(self, config: MoEGPTConfig, ep_group: ProcessGroup | None = None) -> None:
        if not isinstance(config, MoEGPTConfig):
            raise TypeError(f"config must be a MoEGPTConfig, got {type(config).__name__}")
        GPT.__init__(self, config)
        device = self.wte.weight.device
        for i, block in enumerate(self.blocks):
            if config.is_moe_block(i):
                block.mlp = MoE(config.moe_config(), ep_group, device=device)
        if not self.wte.weight.is_meta:
            self.init_weights()  # again, now that the MoE layers exist

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation; every expert is initialised like the dense MLP it replaces
        (N(0, 0.02) input weights, output weights scaled by 1/sqrt(2 * n_layer), zero biases),
        the router gate N(0, 0.02)."""
        GPT.init_weights(self, generator)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for layer in moe_layers(self):
            for name, p in layer.experts.named_parameters():
                if name.startswith("b_"):
                    p.zero_()
                elif name == "w_out":
                    p.normal_(0.0, resid_std, generator=generator)

    def aux_loss(self) -> torch.Tensor:
        """Weighted auxiliary losses of the last forward, summed over MoE layers (0 before any)."""
        loss = moe_aux_loss(self)
        return loss if loss is not None else self.wte.weight.new_zeros(())

    def moe_stats(self) -> list[MoEStats]:
        """Each MoE layer's :class:`colossal.moe.MoEStats` from the last forward (in block order)."""
        return [m.stats for m in moe_layers(self) if m.stats is not None]


MOE_PRESETS: dict[str, dict] = {
    "moe-tiny": dict(n_embd=32, n_layer=2, n_head=4, block_size=64, num_experts=4),  # tests and CPU demos
    "moe-mini": dict(n_embd=128, n_layer=4, n_head=4, block_size=128, num_experts=8),
    "moe-small": dict(n_embd=512, n_layer=12, n_head=8, block_size=256, num_experts=8),
    # Switch-Base widths (d_model 768, d_ff 3072, 12 heads, 12 layers, every other FFN sparse)
    "switch-base-8": dict(n_embd=768, n_layer=12, n_head=12, block_size=512, num_experts=8),
    "switch-base-64": dict(n_embd=768, n_layer=12, n_head=12, block_size=512, num_experts=64),
    "switch-base-128": dict(n_embd=768, n_layer=12, n_head=12, block_size=512, num_experts=128),
}
"""Preset name -> :class:`MoEGPTConfig` fields (``moe_every=2``, top-1, capacity 1.25 unless overridden)."""


def moe_gpt_config(preset: str = "moe-tiny", **overrides) -> MoEGPTConfig:
    """The :class:`MoEGPTConfig` of ``preset`` with ``overrides`` applied."""
    if preset not in MOE_PRESETS:
        raise ValueError(f"preset must be one of {sorted(MOE_PRESETS)}, got {preset!r}")
    fields = {f.name for f in dataclasses.fields(MoEGPTConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown MoEGPTConfig fields {sorted(unknown)}; expected some of {sorted(fields)}")
    return MoEGPTConfig(**{**MOE_PRESETS[preset], **overrides})


def build_moe_gpt(
    preset: str | MoEGPTConfig = "moe-tiny",
    *,
    ep_group: ProcessGroup | None = None,
    device: torch.device | str | None = None,
    lazy: bool = False,
    seed: int | None = None,
    **overrides,
) -> MoEGPT:
    """Build an :class:`MoEGPT` from a preset name (or a config).

    ``lazy=True`` returns it on the meta device (materialise later). ``seed`` makes the
    initialisation reproducible (on CPU, then moved to ``device``). With ``ep_group`` each rank
    holds only its experts; they are drawn from the rank's own generator stream, so use
    :func:`colossal.moe.MoE.from_dense` on a full model when every rank must match one process.
    """
    config = preset if isinstance(preset, MoEGPTConfig) else moe_gpt_config(preset, **overrides)
    with torch.device("meta"):
        model = MoEGPT(config, ep_group)
    if lazy:
        return model
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return model.materialize("cpu", generator=gen).to(device or "cpu")
