"""Parameter groups for large-batch recipes: no weight decay and no trust ratio on biases and norms."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["large_batch_param_groups"]


def large_batch_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters the way the LAMB and LARS papers' recipes do.

    Tensors of two or more dimensions (weights of linear, conv and embedding layers) get
    ``weight_decay`` and the trust ratio; one-dimensional ones (biases, LayerNorm/BatchNorm
    weights) get neither: ``[{"params": decayed, "weight_decay": wd},
    {"params": excluded, "weight_decay": 0.0, "trust_ratio": False}]`` (empty groups dropped).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    decayed, excluded = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decayed if p.dim() >= 2 else excluded).append(p)
    groups = [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": excluded, "weight_decay": 0.0, "trust_ratio": False},
    ]
    return [g for g in groups if g["params"]]
