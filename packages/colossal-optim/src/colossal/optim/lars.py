"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg, "Large Batch Training of
Convolutional Networks", 2017, Algorithm 1).

Per parameter ``w`` with gradient ``g``, global learning rate ``lr``, momentum ``m``::

    ratio = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)   (1 where ||w|| or ||g|| is 0)
    v = m v + lr * ratio * (g + weight_decay * w)                 (v starts at 0)
    w = w - v

The learning rate sits inside the momentum, as in the paper (it matters when a scheduler changes
``lr``). A group with ``trust_ratio=False`` (biases, norm weights) uses ``ratio = 1``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ._layerwise import LayerwiseOptimizer, NormReducer, check_grad, sq_norms, trust_ratio

__all__ = ["Lars"]


class Lars(LayerwiseOptimizer):
    """LARS optimizer (see the module docstring for the update rule).

    Args:
        params: parameters or parameter groups; a group may set ``trust_ratio=False`` and
            ``weight_decay=0`` (see :func:`colossal.optim.large_batch_param_groups`).
        lr: global learning rate.
        momentum: momentum coefficient in [0, 1).
        weight_decay: L2 weight decay inside the trust ratio and the update.
        eta: trust coefficient.
        eps: added to the trust ratio's denominator.
        trust_ratio: default of the per-group switch of the trust ratio.
        norm_reducer: for sharded parameters (see ``[Note: sharded trust ratios]``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        *,
        eta: float = 1e-3,
        eps: float = 1e-8,
        trust_ratio: bool = True,
        norm_reducer: NormReducer | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not eta > 0.0:
            raise ValueError(f"eta must be > 0, got {eta}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps, trust_ratio=trust_ratio)
        super().__init__(params, defaults, norm_reducer)

    def _prepare(self, group: dict[str, Any], params: list[Tensor]) -> tuple[list[Tensor | None], Tensor]:
        grads = [p.grad for p in params]
        for p in params:
            if p.grad is not None:
                check_grad(p, "Lars")
        device = params[0].device if params else torch.device("cpu")
        return grads, torch.cat([sq_norms(list(params), device), sq_norms(grads, device)])

    def _apply(self, group: dict[str, Any], params: list[Tensor], grads: list, w_sq: Tensor, g_sq: Tensor) -> None:
        lr, wd, momentum = float(group["lr"]), float(group["weight_decay"]), float(group["momentum"])
        if group["trust_ratio"]:
            ratio = trust_ratio(w_sq, g_sq, lambda w_norm, g_norm: (g_norm + wd * w_norm + group["eps"]) / group["eta"])
            scales = (ratio * lr).tolist()
        else:
            scales = [lr] * len(params)
        for p, g, scale in zip(params, grads, scales):
            if g is None:
                continue
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if momentum == 0.0 or buf is None:
                buf = torch.mul(g, scale)  # v_1 = lr * ratio * d (v_0 = 0)
                if momentum != 0.0:
                    state["momentum_buffer"] = buf
            else:
                buf.mul_(momentum).add_(g, alpha=scale)
            if wd:
                buf.add_(p, alpha=scale * wd)
            p.sub_(buf)
