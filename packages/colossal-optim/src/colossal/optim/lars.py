"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg, "Large Batch Training of
Convolutional Networks", 2017, Algorithm 1).

Per parameter ``w`` with gradient ``g``, global learning rate ``lr``, momentum ``m``::

    ratio = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)   (1 where ||w|| or ||g|| is 0)
    v = m v + lr * ratio * (g + weight_decay * w)                 (v starts at 0)
    w = w - v

The learning rate sits inside the momentum, as in the paper (it matters when a scheduler changes
``lr``). A group with ``trust_ratio=False`` (biases, norm weights) uses ``ratio = 1``. Each
tensor's update is one pass of torch's fused SGD kernel (see ``[Note: LARS through the fused SGD
kernel]``): the momentum buffer in the state is ``v / (lr * ratio)`` of the last step, with that
scale stored as ``state["scale"]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ._layerwise import LayerwiseOptimizer, NormReducer, sq_norms, trust_ratio

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
        flatten: move float32/float64 CPU parameters (and momentum buffers) into flat buffers, so
            the norms are one call per group (``[Note: flat LAMB/LARS]``); False keeps every
            tensor where it is (needed when the parameters are views of someone else's storage).
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
        flatten: bool = True,
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
        super().__init__(params, defaults, norm_reducer, flatten)

    def _prepare(self, group: dict[str, Any], params: list[Tensor]) -> tuple[list[Tensor | None], Tensor]:
        w_sq, g_sq = self._norm_buffers(params, "Lars")
        device, dtype = w_sq.device, w_sq.dtype
        positions, done = {id(p): i for i, p in enumerate(params)}, set()
        moments = ("momentum_buffer",) if group["momentum"] else ()
        for flat in self._flat_spaces(group, moments, step=False):
            idx = flat.ready(positions)
            if idx is None:
                continue
            flat.space.gather_grads()  # every p.grad becomes a view of the flat gradient buffer
            w_sq[idx.to(device)] = flat.seg.sq_norms(flat.space.param_flat).to(device, dtype)
            g_sq[idx.to(device)] = flat.seg.sq_norms(flat.space.grad_flat).to(device, dtype)
            done.update(id(p) for p in flat.space.params)
        grads = [p.grad for p in params]
        rest = [i for i, p in enumerate(params) if id(p) not in done]
        if rest:
            index = torch.tensor(rest, device=device)
            w_sq[index] = sq_norms([params[i] for i in rest], device).to(dtype)
            g_sq[index] = sq_norms([grads[i] for i in rest], device).to(dtype)
        return grads, torch.cat([w_sq, g_sq])

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
            self._fused_update(p, g, scale, wd, momentum)

    def _fused_update(self, p: Tensor, g: Tensor, scale: float, wd: float, momentum: float) -> None:
        # [Note: LARS through the fused SGD kernel]
        # torch's fused SGD does, in one pass: d = g + wd * w; b = mu * b + d; w -= lr * b.
        # The paper's v_t = m v_(t-1) + s_t d (s_t = lr * ratio changes every step) is kept as
        # b_t = v_t / s_t, so mu = m * s_(t-1) / s_t and lr = s_t give exactly w -= v_t.
        # state["momentum_buffer"] holds b, state["scale"] holds s of the step that wrote it.
        if momentum == 0.0:
            self._sgd(p, g, [], wd, 0.0, scale)
            return
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["scale"] = 1.0
        buf, prev = state["momentum_buffer"], float(state.get("scale", 1.0))  # a flat buffer starts without
        if scale == 0.0:  # v_t = m v_(t-1): decay b, keep its scale
            buf.mul_(momentum)
            p.sub_(buf, alpha=prev)
            return
        self._sgd(p, g, [buf], wd, momentum * prev / scale, scale)
        state["scale"] = scale

    @staticmethod
    def _sgd(p: Tensor, g: Tensor, bufs: list[Tensor], wd: float, momentum: float, lr: float) -> None:
        torch._fused_sgd_(
            [p], [g], bufs, weight_decay=wd, momentum=momentum, lr=lr, dampening=0.0, nesterov=False,
            maximize=False, is_first_step=False,
        )  # fmt: skip
