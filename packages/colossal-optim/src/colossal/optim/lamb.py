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
``weight_decay * w`` (or zeros) with ``lr=-1``: one pass reads g, m, v, u and writes m, v, u.
Without bias correction the kernel is handed a huge step count, for which ``1 - b^t`` is exactly
1. Then come the per-tensor squared norms of w and u and one ``w += -lr * ratio * u`` pass. On
flat buffers (``[Note: flat LAMB/LARS]``) each of these four passes is one kernel call for the
whole group: ``u = wd * w`` (8 bytes per fp32 element), the fused Adam pass (28), the two
row-wise norms (8), the broadcast ``addcmul_`` (12): 56 bytes per element against Adam's 28.
With ``fused="compile"`` the flat spaces take two ``torch.compile``'d passes instead
(``[Note: compiled LAMB]``, 40 bytes per element); the per-tensor path is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from . import _lamb_compiled as compiled
from ._flat import ADAM_MOMENTS
from ._layerwise import (
    Flat,
    LayerwiseOptimizer,
    NormReducer,
    by_device_dtype,
    check_adam_hyperparameters,
    sq_norms,
    trust_ratio,
)

__all__ = ["Lamb"]

_NO_BIAS_CORRECTION_STEP = float(2**30)  # b ** 2**30 underflows to 0 for any b < 1 - 1e-8
FUSED = ("torch", "compile")


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
        flatten: move float32/float64 CPU parameters into flat buffers (``[Note: flat
            LAMB/LARS]``); False keeps every tensor where it is (needed when the parameters are
            views of someone else's storage, e.g. ZeRO/Gemini shards).
        fused: ``"torch"`` (torch's fused Adam kernel plus three passes, 56 bytes per fp32
            element) or ``"compile"``: the flat spaces run two ``torch.compile``'d passes (40
            bytes per element, ``[Note: compiled LAMB]``; compiled at the first step, a few
            seconds). Needs Inductor's C++ compiler; if compilation
            fails the first step raises ``RuntimeError`` suggesting ``fused="torch"``. The
            state_dicts of both are the same.
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
        flatten: bool = True,
        fused: str = "torch",
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if fused not in FUSED:
            raise ValueError(f"fused must be one of {FUSED}, got {fused!r}")
        self.fused = fused
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            adam=adam, trust_ratio=trust_ratio,
        )  # fmt: skip
        super().__init__(params, defaults, norm_reducer, flatten)
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

    def _prepare(self, group: dict[str, Any], params: list[Tensor]) -> tuple[tuple, Tensor]:
        w_sq, u_sq = self._norm_buffers(params, "Lamb")
        device, dtype = w_sq.device, w_sq.dtype
        positions, flat_plans, done = {id(p): i for i, p in enumerate(params)}, [], set()
        for flat in self._flat_spaces(group, ADAM_MOMENTS, step=True) if group["eps"] > 0 else []:
            idx = flat.ready(positions)
            if idx is None or (moments := self._flat_moments(group, flat)) is None:
                continue
            w_sq[idx.to(device)], u_sq[idx.to(device)] = (sq.to(device, dtype) for sq in moments[1])
            flat_plans.append((flat, idx, moments[0]))
            done.update(id(p) for p in flat.space.params)
        rest = [i for i, p in enumerate(params) if id(p) not in done]
        us = self._tensor_moments(group, [params[i] for i in rest])
        if rest:
            index = torch.tensor(rest, device=device)
            w_sq[index] = sq_norms([params[i] for i in rest], device).to(dtype)
            u_sq[index] = sq_norms(us, device).to(dtype)
        return (flat_plans, rest, us), torch.cat([w_sq, u_sq])

    def _steps(self, group: dict[str, Any], steps: list[Tensor], device: torch.device) -> list[Tensor]:
        torch._foreach_add_(steps, 1.0)
        if not group["bias_correction"]:
            return [torch.full((), _NO_BIAS_CORRECTION_STEP, device=device)] * len(steps)
        return steps

    def _adam(self, group: dict[str, Any], us, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        beta1, beta2 = group["betas"]
        torch._fused_adam_(
            us, grads, exp_avgs, exp_avg_sqs, [], steps, lr=-1.0, beta1=beta1, beta2=beta2, weight_decay=0.0,
            eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    def _flat_moments(self, group: dict[str, Any], flat: Flat) -> tuple[Tensor, tuple] | None:
        """Moments of a whole flat space, then ``u`` (``fused="torch"``) or the step scalars of
        ``[Note: compiled LAMB]``, and ``(||w||^2, ||u||^2)`` per parameter; None if the step
        counts differ."""
        space, seg = flat.space, flat.seg
        steps = [self.state[p]["step"] for p in space.params]
        if len(steps) > 1 and not bool((torch.stack(steps) == steps[0]).all()):
            return None  # some parameters skipped steps: the per-tensor path handles them
        step = self._steps(group, steps, torch.device("cpu"))[:1]
        space.gather_grads()
        if self.fused == "compile":
            s = compiled.step_scalars(group, float(step[0]), space.exp_avg.dtype)
            rows = [seg.rows(t) for t in (space.grad_flat, space.exp_avg, space.exp_avg_sq, space.param_flat)]
            return s, tuple(map(seg.per_param, compiled.moments_and_row_norms(*rows, s, flat.ones())))
        u = flat.scratch()
        torch.mul(space.param_flat, group["weight_decay"], out=u) if group["weight_decay"] else u.zero_()
        self._adam(group, [u], [space.grad_flat], [space.exp_avg], [space.exp_avg_sq], step)
        return u, (seg.sq_norms(space.param_flat), seg.sq_norms(u))

    def _tensor_moments(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor | None]:
        """The per-tensor path: ``u`` per parameter (None without a gradient)."""
        us: list[Tensor | None] = [None] * len(params)
        live = [i for i, p in enumerate(params) if p.grad is not None]
        for (device, _), idx in by_device_dtype(live, params).items():
            ps = [params[i] for i in idx]
            states = [self._state(p) for p in ps]
            steps = self._steps(group, [s["step"] for s in states], device)
            for i, p in zip(idx, ps):
                us[i] = u = self._update_buffer(p)
                torch.mul(p, group["weight_decay"], out=u) if group["weight_decay"] else u.zero_()
            grads, exp_avgs, exp_avg_sqs = (
                [p.grad for p in ps],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
            )
            self._adam(group, [us[i] for i in idx], grads, exp_avgs, exp_avg_sqs, steps)
        return us

    def _apply(self, group: dict[str, Any], params: list[Tensor], plan: tuple, w_sq: Tensor, u_sq: Tensor) -> None:
        flat_plans, rest, us = plan
        if group["trust_ratio"] and not group["adam"]:
            scales = trust_ratio(w_sq, u_sq, lambda w_norm, u_norm: u_norm) * -float(group["lr"])
        else:
            scales = torch.full_like(w_sq, -float(group["lr"]))
        for flat, idx, u in flat_plans:
            space, seg = flat.space, flat.seg
            if self.fused == "compile":  # u holds the step scalars
                column = seg.column(scales.cpu()[idx], space.param_flat.dtype)
                rows = [seg.rows(t) for t in (space.exp_avg, space.exp_avg_sq, space.param_flat)]
                compiled.apply_scaled(*rows, u, column)
            else:
                seg.add_scaled_(space.param_flat, u, scales.cpu()[idx])
        for i, u, scale in zip(rest, us, scales[rest].tolist() if rest else []):
            if u is not None:
                params[i].add_(u, alpha=scale)
