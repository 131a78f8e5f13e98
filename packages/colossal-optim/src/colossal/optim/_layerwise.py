"""The shared skeleton of LAMB and LARS: per-tensor trust ratios from (possibly sharded) norms.

[Note: sharded trust ratios]
LAMB and LARS scale each parameter's update by ``||w|| / ||x||`` (x = the Adam-style update for
LAMB, the gradient for LARS). When ZeRO or Gemini hand the optimizer only a shard of each
parameter, those norms must still be the whole parameter's. A step therefore runs in two phases:
``_prepare`` (per group: moments and the local squared norms of the shards this rank holds),
then one call of ``norm_reducer`` on the concatenated squared norms of *every* group (one
all-reduce per step with :func:`colossal.optim.group_norm_reducer`), then ``_apply``. With a
reducer every parameter of every group enters the norm vector, with or without a gradient, so the
vector has the same length and order on every rank (a parameter without a gradient contributes
its weight norm and a zero update norm and is not updated).

[Note: flat LAMB/LARS]
With ``flatten=True`` (the default) the float32/float64 CPU parameters of a group are moved into
flat buffers aligned to rows (``[Note: segments of an aligned flat buffer]``), as ``CPUAdam``
does, so the elementwise passes are one kernel call over the whole group and the per-parameter
norms and scalings are one call each, whatever the number of tensors. Only parameters alone in
their storage are moved: a view into someone else's buffer (a ZeRO master shard) stays where it
is, so that buffer keeps receiving the updates. Parameters that are not moved (accelerator,
fp16/bf16, views, empty) and steps where some parameter of a flat space has no gradient go
through the per-tensor path, with identical results up to the summation order of the norms.
The state keys are the per-tensor path's (views of the flat buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._flat import FlatSpace, flattenable
from ._segments import ROW, Segments

__all__ = [
    "LayerwiseOptimizer",
    "check_grad",
    "check_adam_hyperparameters",
    "trust_ratio",
    "sq_norms",
    "by_device_dtype",
    "Flat",
]

NormReducer = Callable[[Tensor], Tensor]


def check_grad(p: Tensor, optimizer: str) -> None:
    """Refuse gradients the optimizer cannot handle, naming what is supported."""
    if p.grad.is_sparse:
        raise TypeError(f"{optimizer} does not support sparse gradients (got layout {p.grad.layout}); use dense ones")
    if p.is_complex() or p.grad.is_complex():
        raise TypeError(f"{optimizer} supports real floating-point parameters only, got dtype {p.dtype}")


def by_device_dtype(indices: Iterable[int], tensors: list[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` bucketed by (device, dtype): the unit of one multi-tensor kernel."""
    buckets: dict[tuple, list[int]] = {}
    for i in indices:
        buckets.setdefault((tensors[i].device, tensors[i].dtype), []).append(i)
    return buckets


def sq_norms(tensors: list[Tensor | None], device: torch.device) -> Tensor:
    """Squared L2 norms, one per entry (0 for ``None`` and empty tensors), fp32 (fp64 if any input is)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    out = torch.zeros(len(tensors), dtype=torch.float64 if wide else torch.float32, device=device)
    present = [i for i, t in enumerate(tensors) if t is not None and t.numel()]
    for (_, dtype), idx in by_device_dtype(present, tensors).items():  # type: ignore[arg-type]
        widen = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        norms = torch.stack(torch._foreach_norm([tensors[i] for i in idx], 2, dtype=widen))
        out[torch.tensor(idx, device=device)] = norms.to(device, out.dtype).square()
    return out


def trust_ratio(w_sq: Tensor, x_sq: Tensor, denom: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``||w|| / denom(||w||, ||x||)`` per tensor, 1 where ``||w||`` or ``||x||`` is zero."""
    w_norm, x_norm = w_sq.sqrt(), x_sq.sqrt()
    ratio = w_norm / denom(w_norm, x_norm)
    return torch.where((w_norm > 0) & (x_norm > 0), ratio, torch.ones_like(ratio))


class Flat:
    """One flat space of a group with its row index and a lazily allocated scratch buffer."""

    def __init__(self, space: FlatSpace) -> None:
        self.space, self.seg = space, Segments(space)
        self._scratch: Tensor | None = None
        self._ones: Tensor | None = None

    def scratch(self) -> Tensor:
        """A persistent buffer shaped like the space (a fresh one every step would page-fault)."""
        if self._scratch is None:
            self._scratch = torch.zeros_like(self.space.param_flat)
        return self._scratch

    def ones(self) -> Tensor:
        """A ``(rows, 1)`` column of ones of the space's master dtype (``[Note: compiled LAMB]``)."""
        if self._ones is None:
            self._ones = torch.ones(self.seg.total_rows, 1, dtype=self.space.exp_avg.dtype)
        return self._ones

    def ready(self, positions: dict[int, int]) -> Tensor | None:
        """Positions of the space's params among the step's params, or None unless all have a gradient."""
        if not all(p.grad is not None and id(p) in positions for p in self.space.params):
            return None
        return torch.tensor([positions[id(p)] for p in self.space.params])


class LayerwiseOptimizer(Optimizer):
    """Base class: runs ``_prepare`` over all groups, reduces the norms, runs ``_apply``."""

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], norm_reducer: NormReducer | None, flatten: bool = True
    ) -> None:
        if norm_reducer is not None and not callable(norm_reducer):
            raise TypeError(f"norm_reducer must be callable or None, got {type(norm_reducer).__name__}")
        super().__init__(params, defaults)
        self.norm_reducer = norm_reducer
        self.flatten = bool(flatten)
        self._flats: dict[int, tuple[dict[str, Any], list[Flat]]] = {}  # id(group) -> (group, spaces)

    def _flat_spaces(self, group: dict[str, Any], moments: tuple[str, ...], step: bool) -> list[Flat]:
        """The group's flat spaces (built at first use, rebuilt if params moved); [] without flatten."""
        if not self.flatten:
            return []
        entry = self._flats.get(id(group))
        if (
            entry is None
            or entry[0] is not group
            or not all(f.space.intact() and tuple(f.space.moments) == moments for f in entry[1])
        ):
            buckets: dict[torch.dtype, list[Tensor]] = {}
            for p in group["params"]:
                if self._may_flatten(p):
                    buckets.setdefault(p.dtype, []).append(p)
            flats = [
                Flat(FlatSpace(ps, self.state, ps[0].dtype, align=ROW, moments=moments, step=step))
                for ps in buckets.values()
            ]
            entry = self._flats[id(group)] = (group, flats)
        return entry[1]

    def _may_flatten(self, p: Tensor) -> bool:
        """A non-empty float32/float64 CPU tensor alone in its storage, or in one of our flat buffers:
        never a view into someone else's buffer (``[Note: whose storage may be moved]``)."""
        return flattenable(p) and p.numel() > 0 and p.dtype in (torch.float32, torch.float64)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict (of either layout); flat buffers are rebuilt from it at the next step."""
        super().load_state_dict(state_dict)
        self._flats.clear()

    @staticmethod
    def _norm_buffers(params: list[Tensor], optimizer: str) -> Tensor:
        """Check the gradients, then zeros ``(2, len(params))`` for the local squared norms (of the
        weights and of x), fp64 when any parameter is, on the first parameter's device."""
        for p in params:
            if p.grad is not None:
                check_grad(p, optimizer)
        device = params[0].device if params else torch.device("cpu")
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        return torch.zeros(2, len(params), dtype=dtype, device=device)

    def _prepare(self, group: dict[str, Any], params: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Return the per-parameter tensors x (whose norm enters the ratio) and local ``[w_sq | x_sq]``."""
        raise NotImplementedError

    def _apply(self, group: dict[str, Any], params: list[Tensor], xs: list[Tensor], w_sq: Tensor, x_sq: Tensor):
        """Update ``params`` given whole-parameter squared norms."""
        raise NotImplementedError

    def _step_params(self, group: dict[str, Any]) -> list[Tensor]:
        if self.norm_reducer is not None:
            return list(group["params"])
        return [p for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step (see ``[Note: sharded trust ratios]``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name = type(self).__name__
        with torch.profiler.record_function(f"colossal.optim::{name.lower()}_prepare"):
            plans = []
            for group in self.param_groups:
                params = self._step_params(group)
                plans.append((group, params, *self._prepare(group, params)))
        device = plans[0][3].device if plans else torch.device("cpu")
        sq = torch.cat([plan[3].to(device) for plan in plans]) if plans else torch.zeros(0)
        if self.norm_reducer is not None and sq.numel():
            with torch.profiler.record_function(f"colossal.optim::{name.lower()}_norm_reduce"):
                sq = self.norm_reducer(sq)
        offset = 0
        with torch.profiler.record_function(f"colossal.optim::{name.lower()}_apply"):
            for group, params, xs, _local in plans:
                n = len(params)
                w_sq, x_sq = sq[offset : offset + n], sq[offset + n : offset + 2 * n]
                offset += 2 * n
                self._apply(group, params, xs, w_sq, x_sq)
        return loss


def check_adam_hyperparameters(lr: float, betas, eps: float, weight_decay: float) -> None:
    """The ``ValueError`` checks shared by the Adam-family optimizers (Adam, LAMB)."""
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
