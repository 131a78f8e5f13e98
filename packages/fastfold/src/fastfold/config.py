"""Configurations of the Evoformer stack, the Extra-MSA stack and the template pair stack.

Defaults are AlphaFold 2's (Jumper et al. 2021, supplementary Table/section 1.6 and 1.7).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EvoformerConfig", "ExtraMSAConfig", "TemplatePairConfig"]


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


def _check_rate(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{type(obj).__name__}.{name} must be in [0, 1), got {value!r}")


@dataclass(kw_only=True, slots=True)
class EvoformerConfig:
    """The main Evoformer stack (supplementary Algorithm 6)."""

    c_m: int = 256
    """MSA representation channels."""
    c_z: int = 128
    """Pair representation channels."""
    c_s: int = 384
    """Single representation channels (projection of the first MSA row after the last block)."""
    c_hidden_msa_att: int = 32
    """Channels per head of MSA row/column attention."""
    no_heads_msa: int = 8
    """Heads of MSA row/column attention."""
    c_hidden_opm: int = 32
    """Hidden channels of the outer product mean."""
    c_hidden_mul: int = 128
    """Hidden channels of the triangle multiplicative updates."""
    c_hidden_pair_att: int = 32
    """Channels per head of triangle self-attention."""
    no_heads_pair: int = 4
    """Heads of triangle self-attention."""
    transition_n: int = 4
    """Expansion factor of the MSA and pair transitions."""
    msa_dropout: float = 0.15
    """Row-wise dropout rate after MSA row attention."""
    pair_dropout: float = 0.25
    """Row/column-wise dropout rate after the triangle updates and attentions."""
    no_blocks: int = 48
    """Number of Evoformer blocks."""
    inf: float = 1e9
    """Magnitude of the additive mask bias (``inf * (mask - 1)``)."""
    opm_eps: float = 1e-3
    """Epsilon added to the outer-product-mean normaliser."""

    def __post_init__(self) -> None:
        _check_positive(self, "c_m", "c_z", "c_s", "c_hidden_msa_att", "no_heads_msa", "c_hidden_opm")
        _check_positive(self, "c_hidden_mul", "c_hidden_pair_att", "no_heads_pair", "transition_n", "no_blocks")
        _check_rate(self, "msa_dropout", "pair_dropout")
        if self.inf <= 0 or self.opm_eps <= 0:
            raise ValueError(f"inf and opm_eps must be positive, got inf={self.inf}, opm_eps={self.opm_eps}")


@dataclass(kw_only=True, slots=True)
class ExtraMSAConfig:
    """The Extra-MSA stack (supplementary Algorithm 18): Evoformer blocks on the extra MSA with
    global column attention (Algorithm 19)."""

    c_m: int = 64
    """Extra-MSA representation channels (``c_e`` in the paper)."""
    c_z: int = 128
    """Pair representation channels."""
    c_hidden_msa_att: int = 8
    """Channels per head of MSA row attention and global column attention."""
    no_heads_msa: int = 8
    """Heads of MSA row attention and global column attention."""
    c_hidden_opm: int = 32
    """Hidden channels of the outer product mean."""
    c_hidden_mul: int = 128
    """Hidden channels of the triangle multiplicative updates."""
    c_hidden_pair_att: int = 32
    """Channels per head of triangle self-attention."""
    no_heads_pair: int = 4
    """Heads of triangle self-attention."""
    transition_n: int = 4
    """Expansion factor of the transitions."""
    msa_dropout: float = 0.15
    """Row-wise dropout rate after MSA row attention."""
    pair_dropout: float = 0.25
    """Dropout rate of the pair updates."""
    no_blocks: int = 4
    """Number of Extra-MSA blocks."""
    inf: float = 1e9
    """Magnitude of the additive mask bias."""
    opm_eps: float = 1e-3
    """Epsilon added to the outer-product-mean normaliser."""
    global_eps: float = 1e-10
    """Epsilon of the masked mean in global column attention."""

    def __post_init__(self) -> None:
        _check_positive(self, "c_m", "c_z", "c_hidden_msa_att", "no_heads_msa", "c_hidden_opm")
        _check_positive(self, "c_hidden_mul", "c_hidden_pair_att", "no_heads_pair", "transition_n", "no_blocks")
        _check_rate(self, "msa_dropout", "pair_dropout")
        if self.inf <= 0 or self.opm_eps <= 0 or self.global_eps <= 0:
            raise ValueError("inf, opm_eps and global_eps must be positive")


@dataclass(kw_only=True, slots=True)
class TemplatePairConfig:
    """The template pair stack (supplementary Algorithm 16)."""

    c_t: int = 64
    """Template pair representation channels."""
    c_hidden_tri_att: int = 16
    """Channels per head of triangle self-attention."""
    no_heads: int = 4
    """Heads of triangle self-attention."""
    c_hidden_tri_mul: int = 64
    """Hidden channels of the triangle multiplicative updates."""
    pair_transition_n: int = 2
    """Expansion factor of the pair transition."""
    dropout_rate: float = 0.25
    """Row/column-wise dropout rate of the pair updates."""
    no_blocks: int = 2
    """Number of template pair blocks."""
    inf: float = 1e9
    """Magnitude of the additive mask bias."""

    def __post_init__(self) -> None:
        _check_positive(self, "c_t", "c_hidden_tri_att", "no_heads", "c_hidden_tri_mul", "pair_transition_n")
        _check_positive(self, "no_blocks")
        _check_rate(self, "dropout_rate")
        if self.inf <= 0:
            raise ValueError(f"inf must be positive, got {self.inf}")
