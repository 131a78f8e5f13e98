"""Shared helpers of this package's tests: tolerances and independent per-token references."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TOL = 1e-5
"""fp32 parity: expert parallelism sums the same products in another order (tokens of several
ranks in one grouped matmul, an all-reduce of router gradients), a few ulps times the depth of the
sums; 1e-5 of the tensor's norm is far above that and far below any real bug."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative difference of ``a`` from the reference ``b``."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    """``a`` matches reference ``b`` within ``tol`` (norm-relative), shapes equal."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def reference_keep(expert: torch.Tensor, num_experts: int, cap: int | None) -> torch.Tensor:
    """Capacity by counting, one assignment at a time: all first choices in token order, then all
    second choices, ...; an assignment is kept while its expert has room (GShard)."""
    n, k = expert.shape
    keep = torch.ones(n, k, dtype=torch.bool)
    if cap is None:
        return keep
    load = [0] * num_experts
    for j in range(k):
        for t in range(n):
            e = int(expert[t, j])
            keep[t, j] = load[e] < cap
            load[e] += 1
    return keep


def reference_expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of an ``MLPExperts``/``SwiGLUExperts`` applied to ``x`` (n, C), written out."""
    if hasattr(experts, "w_gate"):
        return (F.silu(x @ experts.w_gate[e]) * (x @ experts.w_in[e])) @ experts.w_out[e]
    h = x @ experts.w_in[e] + (experts.b_in[e] if experts.b_in is not None else 0)
    h = experts.activation(h)
    return h @ experts.w_out[e] + (experts.b_out[e] if experts.b_out is not None else 0)


def reference_moe(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A single-process MoE forward token by token: (output (N, C), keep (N, k)).

    Routes with plain softmax/topk, applies capacity with :func:`reference_keep`, and sums each
    kept choice's expert output times its weight.
    """
    cfg = moe.config
    logits = x @ moe.router.gate.weight.t()
    probs = logits.softmax(-1)
    w, expert = probs.topk(cfg.top_k, dim=-1)
    if cfg.top_k > 1 and cfg.renormalize:
        w = w / w.sum(-1, keepdim=True)
    cap = None
    if cfg.capacity_factor is not None:
        cap = max(cfg.min_capacity, math.ceil(cfg.capacity_factor * x.shape[0] * cfg.top_k / cfg.num_experts))
    keep = reference_keep(expert, cfg.num_experts, cap)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            if keep[t, j]:
                e = int(expert[t, j])
                out[t] = out[t] + w[t, j] * reference_expert(moe.experts, e, x[t : t + 1])[0]
    return out, keep
