"""Shared helpers of this package's tests (importable by rank functions); the test GPT and the
parity checks are ``colossal.testkit``'s."""

from __future__ import annotations

import torch


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s distinct parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def counted(counter, fn):
    """Run ``fn`` with ``counter`` reset first; returns ``(result, dict op -> nbytes)``."""
    counter.reset()
    out = fn()
    return out, dict(counter.nbytes)
