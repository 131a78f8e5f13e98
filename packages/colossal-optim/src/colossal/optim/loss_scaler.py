"""Loss scalers for fp16/bf16 mixed precision, shared by ZeRO and Gemini.

The scaler only keeps the scale and decides how it moves; the engine that owns the gradients
asks :func:`colossal.optim.has_inf_or_nan` whether any rank overflowed (one all-reduce) and feeds
that agreed answer to :meth:`DynamicLossScaler.update`, so every rank's scale stays identical.

[Note: scale sequence]
On an overflow step the growth counter restarts and the hysteresis counter rises; the scale is
multiplied by ``backoff_factor`` (clamped at ``min_scale``) once the hysteresis counter reaches
``hysteresis``, and on every further overflow until the next growth. After ``growth_interval``
consecutive clean steps the scale is multiplied by ``growth_factor`` (clamped at ``max_scale``)
and both counters restart. These are the semantics of Megatron-LM and Colossal-AI
(``DynamicGradScaler``); ``hysteresis=1`` gives torch ``GradScaler`` behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["DynamicLossScaler", "ConstantLossScaler"]


def _check_positive_scale(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class _ScalerBase:
    """Shared arithmetic: multiply the loss, divide the gradients."""

    _scale: float

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Return ``loss * scale`` (call ``.backward()`` on the result)."""
        return loss * self._scale

    def unscale_(self, grads: Iterable[Tensor]) -> None:
        """Divide every gradient by the scale, in place (``None`` entries are skipped)."""
        grads = [g for g in grads if g is not None]
        if not grads or self._scale == 1.0:
            return
        with torch.profiler.record_function("colossal.optim::unscale"), torch.no_grad():
            torch._foreach_div_(grads, self._scale)


class DynamicLossScaler(_ScalerBase):
    """Dynamic loss scale with growth, backoff, hysteresis and clamps (see ``[Note: scale sequence]``).

    Args:
        initial_scale: the starting scale (clamped into ``[min_scale, max_scale]`` is *not* done:
            it must already lie there).
        growth_factor: multiplier (> 1) applied after ``growth_interval`` clean steps.
        backoff_factor: multiplier in (0, 1) applied on an overflow once hysteresis is spent.
        growth_interval: number of consecutive clean steps before growing.
        hysteresis: number of overflows (since the last growth) tolerated before backing off.
        min_scale: lower clamp of the scale.
        max_scale: upper clamp of the scale.
    """

    def __init__(
        self,
        *,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        self._min_scale = _check_positive_scale("min_scale", min_scale)
        self._max_scale = _check_positive_scale("max_scale", max_scale)
        if self._min_scale > self._max_scale:
            raise ValueError(f"min_scale must be <= max_scale, got min_scale={min_scale} > max_scale={max_scale}")
        self._scale = _check_positive_scale("initial_scale", initial_scale)
        if not self._min_scale <= self._scale <= self._max_scale:
            raise ValueError(
                f"initial_scale must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}], got {initial_scale}"
            )
        self._growth_factor = _check_positive_scale("growth_factor", growth_factor)
        if self._growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        self._backoff_factor = _check_positive_scale("backoff_factor", backoff_factor)
        if self._backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        self._growth_interval = _check_int("growth_interval", growth_interval, 1)
        self._hysteresis = _check_int("hysteresis", hysteresis, 1)
        self._growth_step = 0  # consecutive clean steps since the last overflow or growth
        self._hysteresis_step = 0  # overflows since the last growth

    def update(self, found_inf: bool) -> None:
        """Move the scale after a step; ``found_inf`` must be the group-agreed overflow flag."""
        if isinstance(found_inf, Tensor):
            found_inf = bool(found_inf.item())
        if found_inf:
            self._growth_step = 0
            self._hysteresis_step += 1
            if self._hysteresis_step >= self._hysteresis:
                self._scale = max(self._scale * self._backoff_factor, self._min_scale)
            return
        self._growth_step += 1
        if self._growth_step >= self._growth_interval:
            self._growth_step = 0
            self._hysteresis_step = 0
            self._scale = min(self._scale * self._growth_factor, self._max_scale)

    def state_dict(self) -> dict[str, Any]:
        """The scale, both counters and the configuration (plain Python numbers)."""
        return {
            "scale": self._scale,
            "growth_step": self._growth_step,
            "hysteresis_step": self._hysteresis_step,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "hysteresis": self._hysteresis,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (configuration keys are optional)."""
        missing = {"scale", "growth_step", "hysteresis_step"} - set(sd)
        if missing:
            raise KeyError(f"loss scaler state_dict lacks keys {sorted(missing)}; got {sorted(sd)}")
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            if key in sd:
                setattr(self, f"_{key}", float(sd[key]))
        for key in ("growth_interval", "hysteresis"):
            if key in sd:
                setattr(self, f"_{key}", int(sd[key]))
        self._scale = float(sd["scale"])
        self._growth_step = int(sd["growth_step"])
        self._hysteresis_step = int(sd["hysteresis_step"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale}, growth_step={self._growth_step}, "
            f"hysteresis_step={self._hysteresis_step})"
        )


class ConstantLossScaler(_ScalerBase):
    """A fixed loss scale (default 1.0, i.e. no scaling, the bf16 case); :meth:`update` does nothing.

    Args:
        initial_scale: the fixed scale.
    """

    def __init__(self, initial_scale: float = 1.0) -> None:
        self._scale = _check_positive_scale("initial_scale", initial_scale)

    def update(self, found_inf: bool) -> None:
        """No-op: the scale never changes (the engine still skips overflowing steps)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"scale": scale}``."""
        return {"scale": self._scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the scale."""
        if "scale" not in sd:
            raise KeyError(f"loss scaler state_dict lacks key 'scale'; got {sorted(sd)}")
        self._scale = float(sd["scale"])

    def __repr__(self) -> str:
        return f"ConstantLossScaler(scale={self._scale})"
