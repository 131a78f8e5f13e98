"""Shared helpers of this package's tests (importable by rank functions)."""

from __future__ import annotations

import torch

TOL = 1e-5
"""fp32 parity: the parallel layers sum the same products in a different order (split matmuls,
all-reduces), so results differ from dense by a few ulps times the depth of the sums; 1e-5 of the
tensor's norm leaves a wide margin above that and far below any real bug."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative difference of ``a`` from the reference ``b``."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    """``a`` matches reference ``b`` within ``tol`` (norm-relative), shapes equal."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s distinct parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def counted(counter, fn):
    """Run ``fn`` with ``counter`` reset first; returns ``(result, dict op -> nbytes)``."""
    counter.reset()
    out = fn()
    return out, dict(counter.nbytes)
