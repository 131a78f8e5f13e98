"""LAMB on a flat space in two passes compiled by ``torch.compile`` (``Lamb(fused="compile")``).

[Note: compiled LAMB]
Pure torch needs four passes and a scratch buffer for LAMB (56 bytes per fp32 element, see
``[Note: LAMB through the fused Adam kernel]``). Inductor (torch's own compiler: vectorised
OpenMP C++ on CPU, built with the system C++ compiler) fuses the update into two passes over the
row-aligned flat buffers seen as ``(rows, ROW)`` matrices:

1. read g, m, v, w; write m, v in place; compute ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``
   in registers only and return the per-row sums of ``w * w`` and ``u * u`` (24 bytes);
2. recompute ``u`` from the new m, v and w and write ``w += column * u`` with a ``(rows, 1)``
   column of per-row ``-lr * trust_ratio`` (16 bytes).

40 bytes per element and no scratch buffer. The moment updates are multiplied by a ``(rows, 1)``
column of ones: without it Inductor flattens the pointwise moment stores to one dimension and
emits them as a second loop after the row reduction (reading g, m, v again); with it the stores
and the reduction share one loop nest. The step-dependent scalars travel in one small tensor, so
a new step or learning rate never recompiles. The first flat-space size compiles a kernel for
that size (a few seconds, cached on disk by Inductor); the second one recompiles with the row
count symbolic (torch's automatic dynamic shapes), which then serves every size. A change of
``torch.get_num_threads()`` or of the dtype recompiles too. No ``fullgraph=True``: past
``torch._dynamo.config.recompile_limit`` compilations that would be a hard error, without it
torch runs the passes eagerly (slow but still correct).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["step_scalars", "moments_and_row_norms", "apply_scaled"]


def step_scalars(group: dict, step: float, dtype: torch.dtype) -> Tensor:
    """``[b1, 1 - b1, b2, 1 - b2, 1 / bc1, 1 / sqrt(bc2), eps, wd]`` (bc = 1 - b^step) as a tensor."""
    b1, b2 = group["betas"]
    bc1, bc2 = 1.0 - b1**step, 1.0 - b2**step
    values = [b1, 1.0 - b1, b2, 1.0 - b2, 1.0 / bc1, bc2**-0.5, group["eps"], group["weight_decay"]]
    return torch.tensor(values, dtype=dtype)


def _update(m: Tensor, v: Tensor, w: Tensor, s: Tensor) -> Tensor:
    return m * s[4] / (v.sqrt() * s[5] + s[6]) + w * s[7]


def _pass1(g: Tensor, m: Tensor, v: Tensor, w: Tensor, s: Tensor, ones: Tensor) -> tuple[Tensor, Tensor]:
    m_new = (m * s[0] + g * s[1]) * ones
    v_new = (v * s[2] + g * g * s[3]) * ones
    m.copy_(m_new)
    v.copy_(v_new)
    u = _update(m_new, v_new, w, s)
    return (w * w).sum(dim=1), (u * u).sum(dim=1)


def _pass2(m: Tensor, v: Tensor, w: Tensor, s: Tensor, column: Tensor) -> None:
    w.add_(_update(m, v, w, s) * column)


@functools.cache
def _compiled(name: str) -> Callable:
    fn = {"pass1": _pass1, "pass2": _pass2}[name]
    return torch.compile(fn)


def _run(name: str, *args: Tensor):
    try:
        return _compiled(name)(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure gets the same advice
        raise RuntimeError(
            f"Lamb(fused='compile'): the torch.compile'd LAMB {name} failed ({type(exc).__name__}: "
            f"{str(exc)[:300]}); Inductor needs a working C++ compiler on CPU. Use Lamb(..., fused='torch')"
        ) from exc


def moments_and_row_norms(g: Tensor, m: Tensor, v: Tensor, w: Tensor, s: Tensor, ones: Tensor) -> tuple[Tensor, Tensor]:
    """Pass 1 on ``(rows, ROW)`` views: update m, v in place, return per-row ``sum(w^2)``, ``sum(u^2)``."""
    return _run("pass1", g, m, v, w, s, ones)


def apply_scaled(m: Tensor, v: Tensor, w: Tensor, s: Tensor, column: Tensor) -> None:
    """Pass 2 on ``(rows, ROW)`` views: ``w += column * u`` with ``u`` recomputed from m, v, w."""
    _run("pass2", m, v, w, s, column)
