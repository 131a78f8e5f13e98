"""LAMB: layer-wise adaptive moments (You et al., "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes", ICLR 2020, Algorithm 2).

Per parameter ``w`` with gradient ``g`` at step ``t``::

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
    r = m_hat / (sqrt(v_hat) + eps)       (m_hat, v_hat bias-corrected when bias_correction)
    u = r + weight_decay * w              (decoupled weight decay inside the update)
    w = w - lr * (||w|| / ||u||) * u      (trust ratio; 1 where a norm is 0, or with adam=True)

[Note: LAMB through the fused Adam kernel]
``r`` is exactly the step of Adam with learning rate 1, so ``u`` comes out of torch's fused Adam
kernel (``torch._fused_adam_``, CPU and CUDA) run on a scratch buffer holding
``weight_decay * w`` with ``lr=-1``: one pass reads g, m, v, u and writes m, v, u. Without bias
correction the kernel is handed a huge step count, for which ``1 - b^t`` is exactly 1. Then come
the per-tensor norms (``torch._foreach_norm``) and one ``w += -lr * ratio * u`` pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from ._layerwise import (
    LayerwiseOptimizer,
    NormReducer,
    by_device_dtype,
    check_adam_hyperparameters,
    check_grad,
    sq_norms,
    trust_ratio,
)

__all__ = ["Lamb"]

_NO_BIAS_CORRECTION_STEP = float(2**30)  # b ** 2**30 underflows to 0 for any b < 1 - 1e-8


class Lamb(LayerwiseOptimizer):
    """LAMB optimizer (see the module docstring for the update rule).

    Args:
        params: parameters or parameter groups. A group may set ``trust_ratio=False`` (and
            ``weight_decay=0``) to exclude biases and norm weights, see
            :func:`colossal.optim.large_batch_param_groups`.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v_hat)``.
        weight_decay: decoupled weight decay added to the update before the trust ratio.
        bias_correction: divide the moments by ``1 - beta^t``.
        adam: disable the trust ratio everywhere (then LAMB is AdamW with weight decay inside the
            learning rate product).
        trust_ratio: default of the per-group switch of the trust ratio.
        norm_reducer: for sharded parameters, maps this rank's per-parameter squared norms to the
            whole parameters' (``colossal.optim.group_norm_reducer(group)``); see
            ``[Note: sharded trust ratios]``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        adam: bool = False,
        trust_ratio: bool = True,
        norm_reducer: NormReducer | None = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            adam=adam, trust_ratio=trust_ratio,
        )  # fmt: skip
        super().__init__(params, defaults, norm_reducer)
        self._scratch = WeakTensorKeyDictionary()  # param -> update buffer u

    def _update_buffer(self, p: Tensor) -> Tensor:
        # A persistent scratch buffer per parameter (not state): a fresh large allocation every
        # step would page-fault its whole size on CPU.
        u = self._scratch.get(p)
        if u is None or u.shape != p.shape or u.dtype != p.dtype or u.device != p.device:
            u = self._scratch[p] = torch.empty_like(p, memory_format=torch.contiguous_format)
        return u

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _prepare(self, group: dict[str, Any], params: list[Tensor]) -> tuple[list[Tensor | None], Tensor]:
        beta1, beta2 = group["betas"]
        us: list[Tensor | None] = [None] * len(params)
        live = [i for i, p in enumerate(params) if p.grad is not None]
        for i in live:
            check_grad(params[i], "Lamb")
        for (device, _), idx in by_device_dtype(live, params).items():
            ps = [params[i] for i in idx]
            states = [self._state(p) for p in ps]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            if not group["bias_correction"]:
                steps = [torch.full((), _NO_BIAS_CORRECTION_STEP, device=device)] * len(ps)
            for i, p in zip(idx, ps):
                us[i] = u = self._update_buffer(p)
                torch.mul(p, group["weight_decay"], out=u) if group["weight_decay"] else u.zero_()
            torch._fused_adam_(
                [us[i] for i in idx], [p.grad for p in ps], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], steps, lr=-1.0, beta1=beta1, beta2=beta2,
                weight_decay=0.0, eps=group["eps"], amsgrad=False, maximize=False,
            )  # fmt: skip
        device = params[0].device if params else torch.device("cpu")
        return us, torch.cat([sq_norms(list(params), device), sq_norms(us, device)])

    def _apply(self, group: dict[str, Any], params: list[Tensor], us: list, w_sq: Tensor, u_sq: Tensor) -> None:
        if group["trust_ratio"] and not group["adam"]:
            ratio = trust_ratio(w_sq, u_sq, lambda w_norm, u_norm: u_norm)
            scales = (ratio * -float(group["lr"])).tolist()
        else:
            scales = [-float(group["lr"])] * len(params)
        for p, u, scale in zip(params, us, scales):
            if u is not None:
                p.add_(u, alpha=scale)
