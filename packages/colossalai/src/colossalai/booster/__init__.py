"""Booster and plugins."""

from colossalai.booster.booster import Booster, RunState
from colossalai.booster.ddp_plugin import TorchDDPPlugin
from colossalai.booster.plugin import Plugin
from colossalai.booster.precision import Precision
from colossalai.booster.wrappers import BoostedModel, BoostedOptimizer

__all__ = ["Booster", "RunState", "Plugin", "TorchDDPPlugin", "Precision", "BoostedModel", "BoostedOptimizer"]
