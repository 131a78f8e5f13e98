"""Colossal meta-package: Booster and plugins, CLI, checkpoints, models."""

__all__: list[str] = []
