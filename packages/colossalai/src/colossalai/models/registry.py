"""Model families by name, for the CLI (``colossalai train --model``) and configuration files."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from torch import nn

from colossalai.models.moe_gpt import MOE_PRESETS, build_moe_gpt, moe_gpt_config
from colossalai.models.palm import PALM_PRESETS, build_palm, palm_config
from colossalai.models.presets import PRESETS, build_gpt, gpt_config

__all__ = ["ModelFamily", "MODELS", "model_family"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """A model's presets and builders under one name."""

    label: str
    """Display name ("GPT", "PaLM")."""
    presets: Mapping[str, dict]
    """Preset name -> config fields."""
    default_preset: str
    """The preset used when none is named (the main job's size: about a million parameters)."""
    config: Callable[..., object]
    """``config(preset, **overrides)`` -> the family's config dataclass."""
    build: Callable[..., nn.Module]
    """``build(preset, *, seed=..., **overrides)`` -> the model (see :func:`build_gpt`)."""

    def preset(self, name: str | None) -> str:
        """``name``, or the default preset for ``None``; ``ValueError`` for another family's preset."""
        if name is None:
            return self.default_preset
        if name not in self.presets:
            raise ValueError(f"{self.label} presets are {list(self.presets)}, got {name!r}")
        return name


MODELS: dict[str, ModelFamily] = {
    "gpt": ModelFamily(label="GPT", presets=PRESETS, default_preset="mini", config=gpt_config, build=build_gpt),
    "palm": ModelFamily(
        label="PaLM", presets=PALM_PRESETS, default_preset="palm-mini", config=palm_config, build=build_palm
    ),
    "moe-gpt": ModelFamily(
        label="MoE GPT", presets=MOE_PRESETS, default_preset="moe-mini", config=moe_gpt_config, build=build_moe_gpt
    ),
}
"""CLI name -> :class:`ModelFamily`."""


def model_family(name: str) -> ModelFamily:
    """The :class:`ModelFamily` called ``name``."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]
