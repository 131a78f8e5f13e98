"""Models every plugin can run: a nanoGPT-style GPT with named presets."""

from colossalai.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from colossalai.models.presets import LAZY_THRESHOLD, PRESETS, build_gpt, gpt_config

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "PRESETS",
    "LAZY_THRESHOLD",
    "build_gpt",
    "gpt_config",
]
