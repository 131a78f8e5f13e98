"""2.5D tensor parallelism (Tesseract, Wang et al. 2021): ``d`` stacked ``q x q`` SUMMA grids,
``P = q^2 * d``.

The batch is split over ``d * q`` blocks (``xz`` group: depth ``k`` and row ``i``), the hidden
size over ``q`` (``row`` group); weights are the 2D ``q x q`` blocks, *replicated* over the depth
(``dep`` group), whose gradients one all-reduce over ``dep`` sums. Compared with 2D on the same
``P``, activation traffic per rank shrinks (rows are split ``d`` times more) at the price of
``d`` copies of the weights: per-rank parameter bytes are ``dense / q^2 = dense * d / P``. With
``d = 1`` this is exactly 2D. The layers are the 2D ones on a :class:`Grid2D` with depth;
this module names them for 2.5D and provides the entry. Formulas: docs page, section "2.5D".
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.comm import Layout2p5D, Mesh
from colossal.tensor_parallel import two_d
from colossal.tensor_parallel.plan import convert_model, gpt_plan
from colossal.tensor_parallel.validation import grid_side

__all__ = [
    "Linear2p5D",
    "LayerNorm2p5D",
    "Embedding2p5D",
    "VocabParallelEmbedding2p5D",
    "VocabParallelLMHead2p5D",
    "grid_2p5d",
    "split_input_2p5d",
    "gather_output_2p5d",
    "cross_entropy_2p5d",
    "apply_2p5d",
]


class Linear2p5D(two_d.Linear2D):
    """SUMMA linear within each depth layer; weight replicated over ``dep``."""


class LayerNorm2p5D(two_d.LayerNorm2D):
    """LayerNorm over the ``row``-split hidden size; weight replicated over ``dep``."""


class Embedding2p5D(two_d.Embedding2D):
    """Hidden-split embedding; the batch is split over ``d * q`` blocks."""


class VocabParallelEmbedding2p5D(two_d.VocabParallelEmbedding2D):
    """Vocabulary x hidden blocked embedding (reduce-scatter over ``col`` within a depth layer)."""


class VocabParallelLMHead2p5D(two_d.VocabParallelLMHead2D):
    """Vocab-parallel output projection sharing the embedding's layout."""


def grid_2p5d(layout: Layout2p5D | Mesh, axis: str = "tp", depth: int = 1) -> two_d.Grid2D:
    """The :class:`~colossal.tensor_parallel.two_d.Grid2D` of a ``Mesh.layout("2.5d")``, or of a
    ``Mesh`` whose ``axis`` is checked (``q^2 * depth``) and laid out."""
    if isinstance(layout, Mesh):
        grid_side(layout.size(axis), 2, "2.5d", depth)
        layout = layout.layout("2.5d", axis, depth=depth)
    if not isinstance(layout, Layout2p5D):
        raise TypeError(f"expected a Layout2p5D or a Mesh, got {type(layout).__name__}")
    return two_d.Grid2D.of(layout)


def split_input_2p5d(x: torch.Tensor, grid: two_d.Grid2D) -> torch.Tensor:
    """This rank's ``(B/(q*d), ..., H/q)`` block of a replicated tensor (no communication)."""
    return two_d.split_input_2d(x, grid)


def gather_output_2p5d(x: torch.Tensor, grid: two_d.Grid2D) -> torch.Tensor:
    """The full tensor from every rank's block (all-gathers over ``row`` and ``xz``)."""
    return two_d.gather_output_2d(x, grid)


def cross_entropy_2p5d(
    logits: torch.Tensor,
    target: torch.Tensor,
    grid: two_d.Grid2D,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
):
    """Vocab-parallel loss of ``(B/(q*d), ..., V/q)`` logits against the full target, as
    ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``)."""
    return two_d.cross_entropy_2d(logits, target, grid, reduction, ignore_index, label_smoothing)


def apply_2p5d(
    model: nn.Module, layout: Layout2p5D | Mesh, plan: dict | None = None, axis: str = "tp", depth: int = 1
) -> nn.Module:
    """Convert ``model`` in place (default plan :func:`gpt_plan`) on a 2.5D grid."""
    grid, plan = grid_2p5d(layout, axis, depth), plan or gpt_plan("2.5d")
    with torch.profiler.record_function("colossal.tensor_parallel::apply_2p5d"):
        convert_model(model, plan, two_d.layer_factories(grid), grid.q, "2.5d")
        two_d.share_input_gather(model, plan, grid)
        return model
