"""3D tensor parallelism (Bian et al., 2021) on a ``q x q x q`` cube, ``P = q^3``.

Rank ``(a, b, c)`` (``input``, ``weight``, ``output`` coordinates of ``Mesh.layout("3d")``).
Activations come in two orientations that alternate layer by layer:

* ``L0``: batch block ``a``, sub-block ``c``; hidden block ``b`` (``(B/q^2, ..., H/q)``);
* ``L1``: batch block ``a``, sub-block ``b``; hidden block ``c``.

A linear on an ``L0`` input (``Style.COL``) all-gathers the rows over ``output`` (giving batch
block ``a`` whole), all-gathers its weight block ``(out c, in b)`` over ``input``, multiplies,
and reduce-scatters the partial sums over ``weight`` along the rows: the result is ``L1``. A
``Style.ROW`` linear does the same with ``weight`` and ``output`` exchanged, back to ``L0``. So
``q/k/v`` and ``fc_in`` go ``L0 -> L1``, ``out_proj`` and ``fc_out`` ``L1 -> L0``, and the residual
stream stays in ``L0``. Every parameter is split over all ``q^3`` ranks (vectors are gathered
over the two groups that share a block), so each costs ``1/P`` of the dense bytes.
Formulas: see the docs page, section "3D".
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm import Layout3D, Mesh, all_gather_along_dim, gather_along_dim, reduce_scatter_along_dim
from colossal.tensor_parallel._ops import all_reduce_sum, gather_param, rows_chunk, shard_param
from colossal.tensor_parallel.cross_entropy import check_targets, vocab_parallel_cross_entropy
from colossal.tensor_parallel.patch_embed import HiddenLayout, vision_factories
from colossal.tensor_parallel.plan import Style, convert_model, gpt_plan
from colossal.tensor_parallel.validation import check_divisible, grid_side

__all__ = [
    "Grid3D",
    "Linear3D",
    "LayerNorm3D",
    "Embedding3D",
    "VocabParallelEmbedding3D",
    "VocabParallelLMHead3D",
    "split_input_3d",
    "gather_output_3d",
    "cross_entropy_3d",
    "hidden_layout_3d",
    "apply_3d",
]


@dataclasses.dataclass(frozen=True)
class Grid3D:
    """The cube of one tensor-parallel axis; build with :meth:`of`."""

    layout: Layout3D
    """The groups and coordinates (``colossal.comm.Layout3D``)."""

    @classmethod
    def of(cls, layout: Layout3D) -> Grid3D:
        """The grid of a ``Mesh.layout("3d")``."""
        if not isinstance(layout, Layout3D):
            raise TypeError(f"expected a Layout3D, got {type(layout).__name__}")
        return cls(layout)

    @property
    def q(self) -> int:
        """Cube side."""
        return self.layout.q

    def axes(self, orient: str) -> tuple[ProcessGroup, int, ProcessGroup, int]:
        """``(hidden group, hidden block, sub-row group, sub-row block)`` of orientation ``orient``."""
        lay = self.layout
        if orient == "L0":
            return lay.weight, lay.weight_index, lay.output, lay.output_index
        if orient == "L1":
            return lay.output, lay.output_index, lay.weight, lay.weight_index
        raise ValueError(f"orientation must be 'L0' or 'L1', got {orient!r}")

    def row_block(self, orient: str) -> int:
        """This rank's batch block out of ``q^2`` in orientation ``orient``."""
        return self.layout.input_index * self.q + self.axes(orient)[3]


def _vector(v: torch.Tensor, grid: Grid3D, block: int, groups: list) -> nn.Parameter:
    """Block ``block`` of ``q`` of ``v`` along its last dim, sharded over ``groups``."""
    return nn.Parameter(shard_param(v.detach().chunk(grid.q, -1)[block], groups, dim=-1))


class Linear3D(nn.Module):
    """3D linear from orientation ``orient`` (``"L0"`` for ``Style.COL``, ``"L1"`` for ``ROW``)
    to the other one: ``(B/q^2, ..., in/q)`` -> ``(B/q^2, ..., out/q)``."""

    def __init__(self, linear: nn.Linear, grid: Grid3D, orient: str = "L0"):
        super().__init__()
        check_divisible(linear.in_features, grid.q, "in_features", "the 3D cube side q")
        check_divisible(linear.out_features, grid.q**3, "out_features", "q^3 (bias split over the cube)")
        self.grid, self.orient = grid, orient
        h, hi, s, si = grid.axes(orient)
        lay = grid.layout
        block = linear.weight.detach().chunk(grid.q, 0)[si].chunk(grid.q, 1)[hi]  # (out/q, in/q)
        self.weight = nn.Parameter(shard_param(block, [lay.input]))  # (out/q^2, in/q)
        self.bias = None if linear.bias is None else _vector(linear.bias, grid, si, [h, lay.input])

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid3D, orient: str = "L0") -> Linear3D:
        """Copy and split ``linear``."""
        return cls(linear, grid, orient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Input in ``orient``, output in the other orientation."""
        h, _, s, _ = self.grid.axes(self.orient)
        with torch.profiler.record_function("colossal.tensor_parallel::linear3d"):
            x = all_gather_along_dim(x, 0, s)  # (B/q, ..., in/q): batch block a
            w = gather_param(self.weight, [self.grid.layout.input])  # (out/q, in/q)
            y = reduce_scatter_along_dim(F.linear(x, w), 0, h)  # (B/q^2, ..., out/q)
            return y if self.bias is None else y + gather_param(self.bias, [h, self.grid.layout.input], -1)


class LayerNorm3D(nn.Module):
    """LayerNorm over the hidden size split over the orientation's hidden group."""

    def __init__(self, ln: nn.LayerNorm, grid: Grid3D, orient: str = "L0"):
        super().__init__()
        (hidden,) = ln.normalized_shape
        check_divisible(hidden, grid.q**3, "normalized_shape", "q^3 (LayerNorm weight split over the cube)")
        self.grid, self.orient, self.hidden, self.eps = grid, orient, hidden, ln.eps
        h, hi, s, _ = grid.axes(orient)
        self._groups = [s, grid.layout.input]
        self.weight = None if ln.weight is None else _vector(ln.weight, grid, hi, self._groups)
        self.bias = None if ln.bias is None else _vector(ln.bias, grid, hi, self._groups)

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm, grid: Grid3D, orient: str = "L0") -> LayerNorm3D:
        """Copy and split ``ln``."""
        return cls(ln, grid, orient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., H/q)`` -> ``(..., H/q)``, same orientation."""
        h = self.grid.axes(self.orient)[0]
        mean = all_reduce_sum(x.sum(-1, keepdim=True), h) / self.hidden
        xc = x - mean
        y = xc * torch.rsqrt(all_reduce_sum((xc * xc).sum(-1, keepdim=True), h) / self.hidden + self.eps)
        if self.weight is not None:
            y = y * gather_param(self.weight, self._groups, -1)
        return y if self.bias is None else y + gather_param(self.bias, self._groups, -1)


class Embedding3D(nn.Module):
    """Hidden-split embedding producing ``L0``; with ``split_rows`` (token embeddings) it keeps
    batch block ``(a, c)`` of the full ids, without (position embeddings) every row."""

    def __init__(self, emb: nn.Embedding, grid: Grid3D, split_rows: bool = True):
        super().__init__()
        check_divisible(emb.embedding_dim, grid.q**3, "embedding_dim", "q^3 (weight split over the cube)")
        self.grid, self.split_rows = grid, split_rows
        _, hi, s, _ = grid.axes("L0")
        self._groups = [s, grid.layout.input]
        self.weight = _vector(emb.weight, grid, hi, self._groups)  # (V, H/q^3)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, grid: Grid3D, split_rows: bool = True) -> Embedding3D:
        """Copy and split ``emb``."""
        return cls(emb, grid, split_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` -> ``(B/q^2, ..., H/q)`` (``L0``)."""
        if self.split_rows:
            ids = rows_chunk(ids, self.grid.row_block("L0"), self.grid.q**2)
        return F.embedding(ids, gather_param(self.weight, self._groups, -1))


class VocabParallelEmbedding3D(nn.Module):
    """Embedding with block ``(vocab c, hidden b)`` split over ``input``; a reduce-scatter over
    ``output`` sums the vocabulary blocks while splitting batch block ``a``: output ``L0``."""

    def __init__(self, emb: nn.Embedding, grid: Grid3D):
        super().__init__()
        check_divisible(emb.num_embeddings, grid.q**2, "num_embeddings (vocabulary)", "q^2 (the 3D weight blocks)")
        check_divisible(emb.embedding_dim, grid.q, "embedding_dim", "the 3D cube side q")
        self.grid, lay = grid, grid.layout
        self.vocab_start = lay.output_index * emb.num_embeddings // grid.q
        """First vocabulary id of this rank's block."""
        block = emb.weight.detach().chunk(grid.q, 0)[lay.output_index].chunk(grid.q, 1)[lay.weight_index]
        self.weight = nn.Parameter(shard_param(block, [lay.input]))  # (V/q^2, H/q)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, grid: Grid3D) -> VocabParallelEmbedding3D:
        """Copy and split ``emb``."""
        return cls(emb, grid)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full ``(B, ...)`` ids -> ``(B/q^2, ..., H/q)`` (``L0``)."""
        lay = self.grid.layout
        ids = rows_chunk(ids, lay.input_index, self.grid.q)  # batch block a
        check_divisible(ids.shape[0], self.grid.q, "batch per input block", "the 3D cube side q")
        w = gather_param(self.weight, [lay.input])  # (V/q, H/q)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= w.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along_dim(out, 0, lay.output)


class VocabParallelLMHead3D(nn.Module):
    """Output projection sharing :class:`VocabParallelEmbedding3D`'s layout: ``L0`` input ->
    logits ``(B/q^2, ..., V/q)``: batch block ``(a, b)``, vocabulary block ``c``."""

    def __init__(self, linear: nn.Linear, grid: Grid3D):
        super().__init__()
        if linear.bias is not None:
            raise NotImplementedError("a vocab-parallel LM head with a bias is not supported; use bias=False")
        emb = nn.Embedding(linear.out_features, linear.in_features, _weight=linear.weight.detach())
        self.grid, self.weight = grid, VocabParallelEmbedding3D(emb, grid).weight

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid3D) -> VocabParallelLMHead3D:
        """Copy and split ``linear`` (``(V, H)`` weight, no bias)."""
        return cls(linear, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial logits of batch block ``a`` reduce-scattered over ``weight``."""
        lay = self.grid.layout
        x = all_gather_along_dim(x, 0, lay.output)  # (B/q, ..., H/q)
        w = gather_param(self.weight, [lay.input])  # (V/q, H/q)
        return reduce_scatter_along_dim(F.linear(x, w), 0, lay.weight)


def split_input_3d(x: torch.Tensor, grid: Grid3D, orient: str = "L0") -> torch.Tensor:
    """This rank's ``(B/q^2, ..., H/q)`` block of a replicated tensor (no communication)."""
    _, hi, _, _ = grid.axes(orient)
    x = rows_chunk(x, grid.row_block(orient), grid.q**2)
    check_divisible(x.shape[-1], grid.q, "hidden size", "the 3D cube side q")
    return x.chunk(grid.q, -1)[hi]


def gather_output_3d(x: torch.Tensor, grid: Grid3D, orient: str = "L0") -> torch.Tensor:
    """The full tensor from every rank's block (all-gathers: hidden, sub-rows, rows)."""
    h, _, s, _ = grid.axes(orient)
    x = gather_along_dim(gather_along_dim(x, -1, h), 0, s)
    return gather_along_dim(x, 0, grid.layout.input)


def cross_entropy_3d(
    logits: torch.Tensor,
    target: torch.Tensor,
    grid: Grid3D,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
):
    """Loss of the LM head's logits against the full ``(B, ...)`` target (dense mean), as
    ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``)."""
    lay = grid.layout
    check_targets(target, logits.shape[-1] * grid.q, ignore_index)  # the full target: every rank agrees
    target = rows_chunk(target, grid.row_block("L1"), grid.q**2)
    start = lay.output_index * logits.shape[-1]
    groups = (lay.input_x_weight,)
    return vocab_parallel_cross_entropy(
        logits, target, lay.output, start, groups, reduction, ignore_index, label_smoothing
    )


def hidden_layout_3d(grid: Grid3D) -> HiddenLayout:
    """Where the residual stream (``L0``) holds the batch and the hidden size, for the vision
    styles: hidden block ``b``, a hidden tensor's block sharded over ``output`` and ``input``,
    batch block ``(a, c)`` of ``q^2``."""
    _, hi, s, _ = grid.axes("L0")
    gather = functools.partial(gather_output_3d, grid=grid, orient="L0")
    return HiddenLayout("3d", grid.q, hi, (s, grid.layout.input), grid.row_block("L0"), grid.q**2, lambda p: p, gather)


def apply_3d(model: nn.Module, layout: Layout3D | Mesh, plan: dict | None = None, axis: str = "tp") -> nn.Module:
    """Convert ``model`` in place (default plan :func:`gpt_plan`); ``layout`` is a
    ``Mesh.layout("3d")`` or a ``Mesh`` whose ``axis`` is checked (``q^3``) and laid out."""
    if isinstance(layout, Mesh):
        grid_side(layout.size(axis), 3, "3d")
        layout = layout.layout("3d", axis)
    grid = Grid3D.of(layout)
    factories = {
        Style.COL: lambda m: Linear3D(m, grid, "L0"),
        Style.ROW: lambda m: Linear3D(m, grid, "L1"),
        Style.NORM: lambda m: LayerNorm3D(m, grid),
        Style.EMBED: lambda m: Embedding3D(m, grid),
        Style.POS_EMBED: lambda m: Embedding3D(m, grid, split_rows=False),
        Style.VOCAB_EMBED: lambda m: VocabParallelEmbedding3D(m, grid),
        Style.LM_HEAD: lambda m: VocabParallelLMHead3D(m, grid),
    } | vision_factories(hidden_layout_3d(grid))
    with torch.profiler.record_function("colossal.tensor_parallel::apply_3d"):
        return convert_model(model, plan or gpt_plan("3d"), factories, grid.q, "3d")
