"""Models every plugin can run: a nanoGPT-style GPT with named presets, and its mixture-of-experts variant."""

from colossalai.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from colossalai.models.moe_gpt import MOE_PRESETS, MoEGPT, MoEGPTConfig, build_moe_gpt, moe_gpt_config
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
    "MoEGPT",
    "MoEGPTConfig",
    "MOE_PRESETS",
    "build_moe_gpt",
    "moe_gpt_config",
]
