"""The shape and routing policy of one mixture-of-experts layer, validated on construction."""

from __future__ import annotations

import dataclasses

__all__ = ["MoEConfig", "EXPERT_KINDS"]

EXPERT_KINDS = ("mlp", "swiglu")
"""Supported expert networks: ``"mlp"`` (Linear -> activation -> Linear) and ``"swiglu"``
(``(silu(x W_gate) * x W_in) W_out``, the Mixtral / LLaMA feed-forward)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class MoEConfig:
    """One MoE layer: its experts, its router and its auxiliary losses.

    Every check runs here, identically on every rank and before any collective, so a bad value
    raises the same ``ValueError`` everywhere instead of hanging a peer.
    """

    hidden: int
    """Model width C (input and output of every expert)."""
    ffn_hidden: int
    """Inner width F of each expert."""
    num_experts: int
    """Total number of experts E (over all expert-parallel ranks)."""
    top_k: int = 1
    """Experts per token: 1 is Switch, 2 is GShard / Mixtral."""
    capacity_factor: float | None = 1.0
    """Each expert takes at most ``ceil(capacity_factor * N * top_k / E)`` of a rank's ``N``
    tokens (GShard/Switch capacity); the rest are dropped (they pass through the residual).
    ``None`` is dropless (MegaBlocks-style): every assignment runs."""
    min_capacity: int = 4
    """Lower bound of the capacity (DeepSpeed's default), so tiny batches are not all dropped."""
    renormalize: bool = True
    """For ``top_k > 1``: divide the chosen probabilities by their sum (GShard, Mixtral).
    Ignored for ``top_k == 1``, which always weighs by the raw probability (Switch; a
    renormalised single weight would be 1 and give the router no gradient)."""
    jitter: float = 0.0
    """Switch's jitter noise: in training, multiply the router input by ``U(1 - jitter, 1 + jitter)``."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss ``E * sum_e f_e * P_e`` in :attr:`MoE.aux_loss`."""
    z_loss_coef: float = 0.001
    """Weight of the ST-MoE router z-loss ``mean(logsumexp(logits) ** 2)`` in :attr:`MoE.aux_loss`."""
    expert: str = "mlp"
    """Expert network, one of :data:`EXPERT_KINDS`."""
    activation: str = "gelu_tanh"
    """Activation of ``"mlp"`` experts: ``"gelu_tanh"``, ``"gelu"``, ``"relu"`` or ``"silu"``."""
    bias: bool = True
    """Whether ``"mlp"`` experts carry biases (``"swiglu"`` experts never do, as in Mixtral)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn_hidden", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0 (None: dropless), got {self.capacity_factor}")
        if not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise ValueError(f"MoEConfig.min_capacity must be an int >= 0, got {self.min_capacity!r}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"MoEConfig.jitter must lie in [0, 1), got {self.jitter}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.expert not in EXPERT_KINDS:
            raise ValueError(f"MoEConfig.expert must be one of {EXPERT_KINDS}, got {self.expert!r}")
        if self.activation not in ("gelu_tanh", "gelu", "relu", "silu"):
            raise ValueError(f"MoEConfig.activation must be gelu_tanh, gelu, relu or silu, got {self.activation!r}")

    @property
    def dropless(self) -> bool:
        """True when no token is ever dropped (``capacity_factor is None``)."""
        return self.capacity_factor is None
