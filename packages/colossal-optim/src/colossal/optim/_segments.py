"""Per-parameter norms and scalings over an aligned flat buffer, one kernel call each.

[Note: segments of an aligned flat buffer]
LAMB and LARS need, per parameter, a squared norm (of the weight and of the update or gradient)
and a per-parameter scalar applied to a whole-buffer update. Calling a kernel per parameter costs
a parallel region (thread wake-up and barrier) per parameter, which dominates on a busy machine
or with many tensors. When a :class:`~colossal.optim._flat.FlatSpace` is built with
``align=ROW``, every parameter starts at a multiple of ``ROW`` elements and the gaps are zero,
so the buffer seen as a ``(rows, ROW)`` matrix has every row inside one parameter. Then

* the squared norms are one row-wise ``torch.linalg.vector_norm(..., dim=1)`` call (cascade
  summation within a row, a parallel loop over rows), then a tiny ``index_add_`` of the row
  results (in float64) into their parameters;
* ``dst += scale[param] * src`` is one broadcasting ``addcmul_`` with a ``(rows, 1)`` column of
  per-row scales (12 bytes per fp32 element, like a plain ``add_``).

The zero gaps add nothing to the norms and are never changed by the updates (they multiply zero).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._flat import FlatSpace

__all__ = ["ROW", "Segments"]

ROW = 2048  # elements per row: long enough for vectorised rows, short enough to pad little


class Segments:
    """Row-to-parameter index of an aligned :class:`FlatSpace` (``align == ROW``)."""

    def __init__(self, space: FlatSpace) -> None:
        if space.align != ROW:
            raise ValueError(f"Segments needs a FlatSpace with align={ROW}, got align={space.align}")
        rows = [-(-(sl.stop - sl.start) // ROW) for sl in space.slices]
        self.count = len(rows)
        self.row_owner = torch.repeat_interleave(torch.arange(self.count), torch.tensor(rows))  # (rows,)
        self.total_rows = int(self.row_owner.numel())

    def rows(self, flat: Tensor) -> Tensor:
        """``flat`` seen as the ``(rows, ROW)`` matrix whose rows each belong to one parameter."""
        return flat[: self.total_rows * ROW].view(self.total_rows, ROW)

    def per_param(self, row_sums: Tensor) -> Tensor:
        """Sum per-row values into their parameters, float64, shape ``(count,)``."""
        return torch.zeros(self.count, dtype=torch.float64).index_add_(0, self.row_owner, row_sums.double())

    def column(self, scales: Tensor, dtype: torch.dtype) -> Tensor:
        """Per-parameter ``scales`` as a ``(rows, 1)`` column of ``dtype`` (for broadcasting)."""
        return scales.to(dtype)[self.row_owner].unsqueeze(1)

    def sq_norms(self, flat: Tensor) -> Tensor:
        """Squared L2 norm of each parameter's elements of ``flat``, float64, shape ``(count,)``."""
        widen = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None
        return self.per_param(torch.linalg.vector_norm(self.rows(flat), dim=1, dtype=widen).double().square())

    def add_scaled_(self, dst: Tensor, src: Tensor, scales: Tensor) -> None:
        """``dst += scales[i] * src`` on each parameter ``i``'s elements, in one kernel call."""
        self.rows(dst).addcmul_(self.rows(src), self.column(scales, dst.dtype))
