"""Models every plugin can run: a nanoGPT-style GPT with named presets, its mixture-of-experts
variant, and PaLM (parallel blocks, multi-query attention, RoPE, SwiGLU)."""

from colossalai.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from colossalai.models.moe_gpt import MOE_PRESETS, MoEGPT, MoEGPTConfig, build_moe_gpt, moe_gpt_config
from colossalai.models.palm import (
    PALM_PRESETS,
    MultiQueryAttention,
    PaLM,
    PaLMBlock,
    PaLMConfig,
    SwiGLU,
    apply_rope,
    build_palm,
    palm_config,
    palm_loss,
    z_loss,
)
from colossalai.models.presets import LAZY_THRESHOLD, PRESETS, build_gpt, gpt_config
from colossalai.models.registry import MODELS, ModelFamily, model_family

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
    "PaLM",
    "PaLMConfig",
    "PaLMBlock",
    "MultiQueryAttention",
    "SwiGLU",
    "apply_rope",
    "z_loss",
    "palm_loss",
    "PALM_PRESETS",
    "build_palm",
    "palm_config",
    "MODELS",
    "ModelFamily",
    "model_family",
]
