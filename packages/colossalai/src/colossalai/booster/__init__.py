"""Booster and plugins."""

from colossalai.booster.booster import Booster, MoEAuxLoss, RunState
from colossalai.booster.ddp_plugin import TorchDDPPlugin
from colossalai.booster.fsdp_plugin import TorchFSDPPlugin
from colossalai.booster.gemini_plugin import GeminiPlugin
from colossalai.booster.hybrid.plugin import HybridParallelPlugin
from colossalai.booster.plugin import Plugin
from colossalai.booster.precision import Precision
from colossalai.booster.wrappers import BoostedModel, BoostedOptimizer
from colossalai.booster.zero_plugin import ZeroPlugin

__all__ = [
    "Booster",
    "MoEAuxLoss",
    "RunState",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "ZeroPlugin",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "Precision",
    "BoostedModel",
    "BoostedOptimizer",
]
