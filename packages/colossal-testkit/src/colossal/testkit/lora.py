"""A LoRA-style adapter without ``peft``: the engines' tests of frozen parameters (the packages
below the meta-package cannot depend on ``peft``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LowRankAdapted", "add_adapters"]


class LowRankAdapted(nn.Module):
    """``base(x) + B(A(x))``: ``base`` frozen, ``A`` (``r`` x in) and ``B`` (out x ``r``) trainable.
    ``B`` starts random (not zero, as LoRA's does) so that ``A`` gets a gradient at the first step."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def add_adapters(gpt: nn.Module, r: int = 4) -> nn.Module:
    """Freeze the testkit ``GPT`` and put rank-``r`` adapters on every block's q and v projections
    (in place; returns ``gpt``)."""
    gpt.requires_grad_(False)
    for block in gpt.blocks:
        block.attn.q_proj = LowRankAdapted(block.attn.q_proj, r)
        block.attn.v_proj = LowRankAdapted(block.attn.v_proj, r)
    return gpt
