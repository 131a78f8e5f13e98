"""CPUAdam and HybridAdam: Adam/AdamW over CPU and accelerator parameters in one ``step()``.

* CPU parameters (dense, contiguous) are moved into flat buffers (``[Note: why flatten]``) and
  updated by one call of torch's fused vectorised CPU kernel (``torch._fused_adamw_`` /
  ``torch._fused_adam_``) per group and dtype.
* Accelerator parameters (and CPU ones that cannot be flattened) go through the same kernels on
  per-(device, dtype) lists: on CUDA that is torch's fused multi-tensor kernel.
* ``master_weights=True`` keeps fp32 master weights and fp32 moments for fp16/bf16 parameters;
  the working copies are refreshed from the masters after each step.

The results equal ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` bit for bit
in fp32: they run the same kernel. The state keys (``step``, ``exp_avg``, ``exp_avg_sq``, plus
``master``) are torch's, so a state_dict moves between this optimizer and torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._flat import FlatSpace, flattenable
from ._layerwise import check_adam_hyperparameters, check_grad

__all__ = ["CPUAdam", "HybridAdam"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_NO_BIAS_CORRECTION_STEP = float(2**30)  # b ** 2**30 underflows to 0: 1 - b^t is exactly 1


class CPUAdam(Optimizer):
    """Adam/AdamW with flat fused CPU updates and fused multi-tensor accelerator updates.

    Args:
        params: parameters or parameter groups (any mix of CPU and accelerator tensors).
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled (AdamW) or L2 (Adam) weight decay, per ``adamw_mode``.
        adamw_mode: True for ``torch.optim.AdamW`` semantics, False for ``torch.optim.Adam``.
        bias_correction: divide the moments by ``1 - beta^t`` (torch always does).
        master_weights: keep fp32 master weights and moments for fp16/bf16 parameters.
        flatten: move CPU parameters into flat buffers (``[Note: why flatten]``); False keeps
            every tensor where it is (per-tensor kernel calls).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        master_weights: bool = False,
        flatten: bool = True,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
            bias_correction=bias_correction, master_weights=master_weights,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.flatten = flatten
        self._spaces: dict[int, list[FlatSpace]] = {}  # group index -> flat spaces, built at first step

    @staticmethod
    def _master_dtype(group: dict[str, Any], p: Tensor) -> torch.dtype:
        return torch.float32 if group["master_weights"] and p.dtype in _LOW_PRECISION else p.dtype

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        st, dtype = self.state[p], self._master_dtype(group, p)
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if dtype != p.dtype and "master" not in st:
            st["master"] = p.detach().to(dtype, copy=True)
        return st

    def _kernel(self, group: dict[str, Any], params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        beta1, beta2 = group["betas"]
        if not group["bias_correction"]:
            steps = [torch.full((), _NO_BIAS_CORRECTION_STEP, device=params[0].device)] * len(params)
        kernel = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        kernel(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    def _build_spaces(self, group: dict[str, Any]) -> list[FlatSpace]:
        buckets: dict[torch.dtype, list[Tensor]] = {}
        for p in group["params"]:
            if flattenable(p) and p.numel():
                buckets.setdefault(p.dtype, []).append(p)
        return [FlatSpace(ps, self.state, self._master_dtype(group, ps[0])) for ps in buckets.values()]

    def _step_space(self, group: dict[str, Any], space: FlatSpace) -> bool:
        """One kernel call over a flat space; False (nothing done) unless it can step as a whole."""
        if any(p.grad is None for p in space.params):
            return False
        steps = [self.state[p]["step"] for p in space.params]
        if len(steps) > 1 and not bool((torch.stack(steps) == steps[0]).all()):
            return False  # some parameters skipped steps (no grad): update them one by one
        torch._foreach_add_(steps, 1.0)
        space.gather_grads()
        self._kernel(group, [space.master_flat], [space.grad_master], [space.exp_avg], [space.exp_avg_sq], steps[:1])
        space.publish()
        return True

    def _step_list(self, group: dict[str, Any], params: list[Tensor]) -> None:
        buckets: dict[tuple, list[Tensor]] = {}
        for p in params:
            buckets.setdefault((p.device, p.dtype), []).append(p)
        for ps in buckets.values():
            states = [self._init_state(group, p) for p in ps]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1.0)
            if "master" in states[0]:
                masters = [st["master"] for st in states]
                grads = [p.grad.to(masters[0].dtype) for p in ps]
                self._kernel(group, masters, grads, *self._moments(states), steps)
                torch._foreach_copy_(ps, masters)
            else:
                self._kernel(group, ps, [p.grad for p in ps], *self._moments(states), steps)

    @staticmethod
    def _moments(states: list[dict[str, Any]]) -> tuple[list[Tensor], list[Tensor]]:
        return [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step over every group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    check_grad(p, type(self).__name__)
            done: set[int] = set()
            if self.flatten:
                if index not in self._spaces or not all(sp.intact() for sp in self._spaces[index]):
                    self._spaces[index] = self._build_spaces(group)  # first step, or params were moved
                with torch.profiler.record_function("colossal.optim::adam_flat"):
                    for space in self._spaces[index]:
                        if self._step_space(group, space):
                            done.update(id(p) for p in space.params)
            with torch.profiler.record_function("colossal.optim::adam_multi_tensor"):
                self._step_list(group, [p for p in group["params"] if p.grad is not None and id(p) not in done])
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict (this class's or ``torch.optim.Adam``/``AdamW``'s), keeping fp32 masters fp32."""
        super().load_state_dict(state_dict)  # validates; casts floating state to the params' dtype
        saved_groups = state_dict["param_groups"]
        for saved, group in zip(saved_groups, self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                saved_state = state_dict["state"].get(pid)
                if not saved_state:
                    continue
                st, dtype = self.state[p], self._master_dtype(group, p)
                for key, value in saved_state.items():
                    if key == "step":
                        st[key] = torch.as_tensor(value, dtype=torch.float32).to(p.device, copy=True)
                    elif isinstance(value, Tensor):  # re-cast from the saved (full-precision) value
                        st[key] = value.to(device=p.device, dtype=dtype, copy=True)
        self._spaces.clear()  # rebuilt (copying this state in) at the next step


class HybridAdam(CPUAdam):
    """:class:`CPUAdam` under the name Colossal-AI gives the optimizer for mixed CPU/accelerator
    parameter sets (ZeRO or Gemini with offload): CPU parameters by the flat fused CPU kernel,
    accelerator parameters by the fused multi-tensor kernel, both in one ``step()``.
    """
