"""Marks for tensors fresh from the meta device, shared by every engine that materialises one.

[Note: marking tensors a meta build leaves unset]
A meta tensor keeps no values: ``to_empty`` (or ``torch.empty_like``) hands it whatever memory the
allocator had, and a tensor that no initialiser then writes (a buffer built as ``torch.ones(n)``
under ``torch.device("meta")``, a bare ``nn.Parameter``) would train on garbage. Each fresh tensor
is therefore filled with a value no initialiser writes (:func:`unset_mark`: NaN for floating point,
the minimum of signed integers, the byte 0xFF, no valid bool, for bool) before initialisation, and
:func:`unset_names` lists those that still hold it afterwards, for the caller to refuse by name.
Unsigned integers have no unlikely value and stay unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["unset_mark", "mark_unset", "is_unset", "unset_names"]


def unset_mark(t: torch.Tensor) -> float | None:
    """The value that marks ``t`` as not initialised (see ``[Note: marking tensors a meta build
    leaves unset]``), in the uint8 view for bool; ``None`` for unsigned integers."""
    if t.is_floating_point() or t.is_complex():
        return math.nan
    if t.dtype == torch.bool:
        return 255
    low = torch.iinfo(t.dtype).min
    return low if low < 0 else None


def _view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


@torch.no_grad()
def mark_unset(tensors: Iterable[torch.Tensor]) -> None:
    """Fill each (non-meta) tensor with its :func:`unset_mark`."""
    for t in tensors:
        if not t.is_meta and (mark := unset_mark(t)) is not None:
            _view(t.detach()).fill_(mark)


def is_unset(t: torch.Tensor) -> bool:
    """Whether any element of ``t`` still holds its :func:`unset_mark`."""
    mark = unset_mark(t)
    if mark is None or t.numel() == 0 or t.is_meta:
        return False
    view = _view(t.detach())
    return bool((view.isnan() if math.isnan(mark) else view == mark).any())


def unset_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors in ``named`` that still hold their mark."""
    return [n for n, t in named if is_unset(t)]
