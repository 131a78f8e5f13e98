"""Plugins by name, for the CLI and for configuration files."""

from __future__ import annotations

from colossalai.booster.ddp_plugin import TorchDDPPlugin
from colossalai.booster.fsdp_plugin import TorchFSDPPlugin
from colossalai.booster.gemini_plugin import GeminiPlugin
from colossalai.booster.hybrid.plugin import HybridParallelPlugin
from colossalai.booster.plugin import Plugin
from colossalai.booster.zero_plugin import ZeroPlugin

__all__ = ["PLUGINS", "make_plugin"]

PLUGINS: dict[str, type[Plugin]] = {
    "ddp": TorchDDPPlugin,
    "fsdp": TorchFSDPPlugin,
    "zero": ZeroPlugin,
    "gemini": GeminiPlugin,
    "hybrid": HybridParallelPlugin,
}
"""CLI name -> plugin class."""


def make_plugin(name: str, **kwargs) -> Plugin:
    """Instantiate the plugin called ``name`` with ``kwargs``."""
    if name not in PLUGINS:
        raise ValueError(f"plugin must be one of {sorted(PLUGINS)}, got {name!r}")
    return PLUGINS[name](**kwargs)
