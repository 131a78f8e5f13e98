"""2D tensor parallelism (Optimus / SUMMA, Xu et al. 2021) on a ``q x q`` grid, ``P = q^2``.

Rank ``(i, j)`` holds activations as ``(B/q, T, H/q)``: batch block ``i``, hidden block ``j``;
and weights as ``q x q`` blocks (``W[i, j]`` of the ``(in, out)`` matrix). A linear gathers its
input's hidden blocks over the ``row`` group and its weight column over the ``col`` group, then
multiplies locally: the all-gather form of SUMMA's ``q`` broadcast steps (the same bytes), whose
backward reduce-scatters the partial gradients. Vectors (bias, LayerNorm) are split over all
``q^2`` ranks and gathered over ``col``, so every parameter costs ``1/P`` of the dense bytes.

The same classes serve 2.5D (:mod:`~colossal.tensor_parallel.two_p5_d`): a :class:`Grid2D` with
``depth > 1`` splits the batch over ``depth * q`` blocks and replicates weights over ``dep``.
Formulas: see the docs page, section "2D".
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm import (
    Layout2D,
    Layout2p5D,
    Mesh,
    all_gather_along_dim,
    copy_to_group,
    gather_along_dim,
    reduce_scatter_along_dim,
)
from colossal.tensor_parallel._ops import all_reduce_sum, gather_param, rows_chunk
from colossal.tensor_parallel.cross_entropy import check_targets, vocab_parallel_cross_entropy
from colossal.tensor_parallel.patch_embed import HiddenLayout, vision_factories
from colossal.tensor_parallel.plan import Style, convert_model, gpt_plan, resolve_plan
from colossal.tensor_parallel.validation import check_divisible, grid_side

__all__ = [
    "Grid2D",
    "Linear2D",
    "LayerNorm2D",
    "Embedding2D",
    "VocabParallelEmbedding2D",
    "VocabParallelLMHead2D",
    "split_input_2d",
    "gather_output_2d",
    "cross_entropy_2d",
    "hidden_layout_2d",
    "layer_factories",
    "share_input_gather",
    "apply_2d",
]


@dataclasses.dataclass(frozen=True)
class Grid2D:
    """The groups a 2D (``depth == 1``) or 2.5D layer uses; build with :meth:`of`."""

    q: int
    """Grid side."""
    i: int
    """Row index (batch block within a depth layer)."""
    j: int
    """Column index (hidden block)."""
    row: ProcessGroup
    """Same ``i``, ``j`` varying: the hidden blocks of one batch block."""
    col: ProcessGroup
    """Same ``j``, ``i`` varying: the batch blocks of one hidden block (within a depth layer)."""
    rows: ProcessGroup
    """Every rank with this ``j``: the batch is split over it (``col`` in 2D, ``xz`` in 2.5D)."""
    depth: int = 1
    """Stacked layers ``d`` (2.5D); 1 for 2D."""
    k: int = 0
    """Depth index."""
    dep: ProcessGroup | None = None
    """Same ``(i, j)``, ``k`` varying: weights are replicated over it (2.5D)."""

    @classmethod
    def of(cls, layout: Layout2D | Layout2p5D) -> Grid2D:
        """The grid of a ``Mesh.layout("2d" | "2.5d")``."""
        if isinstance(layout, Layout2p5D):
            dep = layout.dep if layout.depth > 1 else None
            rows = layout.xz if layout.depth > 1 else layout.col
            k = layout.dep_index
            return cls(layout.q, layout.row_index, layout.col_index, layout.row, layout.col, rows, layout.depth, k, dep)
        if isinstance(layout, Layout2D):
            return cls(layout.q, layout.row_index, layout.col_index, layout.row, layout.col, layout.col)
        raise TypeError(f"expected a Layout2D or Layout2p5D, got {type(layout).__name__}")

    @property
    def row_blocks(self) -> int:
        """Number of batch blocks (``q * depth``)."""
        return self.q * self.depth

    @property
    def row_block(self) -> int:
        """This rank's batch block (``k * q + i``)."""
        return self.k * self.q + self.i

    def replicated(self, p: torch.Tensor) -> torch.Tensor:
        """A weight replicated over depth: identity forward, gradient summed over ``dep``."""
        return p if self.dep is None else copy_to_group(p, self.dep)


def _block(t: torch.Tensor, grid: Grid2D, dims: tuple[int, int], idx: tuple[int, int]) -> torch.Tensor:
    """Block ``idx`` of ``t`` split ``q`` ways along each of ``dims`` (no communication)."""
    t = t.detach().chunk(grid.q, dims[0])[idx[0]]
    return t.chunk(grid.q, dims[1])[idx[1]].clone()


def _vector(v: torch.Tensor, grid: Grid2D) -> nn.Parameter:
    """Hidden block ``j`` of a vector, split again by ``i``: ``1/q^2`` of it."""
    return nn.Parameter(v.detach().chunk(grid.q)[grid.j].chunk(grid.q)[grid.i].clone())


def _gathered_vector(p: torch.Tensor | None, grid: Grid2D) -> torch.Tensor | None:
    return None if p is None else gather_param(grid.replicated(p), [grid.col])


class Linear2D(nn.Module):
    """SUMMA linear: ``(b, ..., in/q)`` -> ``(b, ..., out/q)``, weight block ``(out/q, in/q)``."""

    def __init__(self, linear: nn.Linear, grid: Grid2D):
        super().__init__()
        check_divisible(linear.in_features, grid.q, "in_features", "the 2D grid side q")
        check_divisible(linear.out_features, grid.q**2, "out_features", "q^2 (bias split over the grid)")
        self.grid = grid
        # dense (out, in) -> rows = out block j, cols = in block i; all-gathered over `col` into (out/q, in)
        self.weight = nn.Parameter(_block(linear.weight, grid, (0, 1), (grid.j, grid.i)))
        self.bias = None if linear.bias is None else _vector(linear.bias, grid)
        self.input_gathered = False
        """The input arrives already gathered over ``row`` (``(b, ..., in)``), see :func:`apply_2d`."""

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid2D) -> Linear2D:
        """Copy and split ``linear``."""
        return cls(linear, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` hidden block ``j`` -> output hidden block ``j``."""
        with torch.profiler.record_function("colossal.tensor_parallel::linear2d"):
            if not self.input_gathered:
                x = all_gather_along_dim(x, -1, self.grid.row)  # (b, ..., in)
            w = gather_param(self.grid.replicated(self.weight), [self.grid.col], dim=1)  # (out/q, in)
            return F.linear(x, w, _gathered_vector(self.bias, self.grid))


class LayerNorm2D(nn.Module):
    """LayerNorm over a hidden size split over ``row``: two all-reduces of per-row sums."""

    def __init__(self, ln: nn.LayerNorm, grid: Grid2D):
        super().__init__()
        (hidden,) = ln.normalized_shape
        check_divisible(hidden, grid.q**2, "normalized_shape", "q^2 (LayerNorm weight split over the grid)")
        self.grid, self.hidden, self.eps = grid, hidden, ln.eps
        self.weight = None if ln.weight is None else _vector(ln.weight, grid)
        self.bias = None if ln.bias is None else _vector(ln.bias, grid)

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm, grid: Grid2D) -> LayerNorm2D:
        """Copy and split ``ln``."""
        return cls(ln, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., H/q)`` -> ``(..., H/q)``."""
        mean = all_reduce_sum(x.sum(-1, keepdim=True), self.grid.row) / self.hidden
        xc = x - mean
        var = all_reduce_sum((xc * xc).sum(-1, keepdim=True), self.grid.row) / self.hidden
        y = xc * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * _gathered_vector(self.weight, self.grid)
        return y if self.bias is None else y + _gathered_vector(self.bias, self.grid)


class Embedding2D(nn.Module):
    """Embedding split along the hidden size (block ``j``, split again by ``i``). Takes the full
    ids; with ``split_rows`` (token embeddings) it keeps batch block ``k*q + i``, without
    (position embeddings) every row."""

    def __init__(self, emb: nn.Embedding, grid: Grid2D, split_rows: bool = True):
        super().__init__()
        check_divisible(emb.embedding_dim, grid.q**2, "embedding_dim", "q^2 (weight split over the grid)")
        self.grid, self.split_rows = grid, split_rows
        self.weight = nn.Parameter(_block(emb.weight, grid, (1, 1), (grid.j, grid.i)))  # (V, H/q^2)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, grid: Grid2D, split_rows: bool = True) -> Embedding2D:
        """Copy and split ``emb``."""
        return cls(emb, grid, split_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` -> ``(B/(q*d), ..., H/q)`` (or ``(B, ..., H/q)`` without ``split_rows``)."""
        if self.split_rows:
            ids = rows_chunk(ids, self.grid.row_block, self.grid.row_blocks)
        return F.embedding(ids, gather_param(self.grid.replicated(self.weight), [self.grid.col], dim=1))


class VocabParallelEmbedding2D(nn.Module):
    """Embedding with block ``(vocab i, hidden j)`` of the ``(V, H)`` weight per rank: every rank
    of ``col`` looks all its depth layer's ids up in its vocabulary block and a reduce-scatter over
    ``col`` sums the vocabulary blocks while splitting the batch."""

    def __init__(self, emb: nn.Embedding, grid: Grid2D):
        super().__init__()
        check_divisible(emb.num_embeddings, grid.q, "num_embeddings (vocabulary)", "the 2D grid side q")
        check_divisible(emb.embedding_dim, grid.q, "embedding_dim", "the 2D grid side q")
        self.grid = grid
        self.vocab_start = grid.i * emb.num_embeddings // grid.q
        """First vocabulary id of this rank's block."""
        self.weight = nn.Parameter(_block(emb.weight, grid, (0, 1), (grid.i, grid.j)))  # (V/q, H/q)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, grid: Grid2D) -> VocabParallelEmbedding2D:
        """Copy and split ``emb``."""
        return cls(emb, grid)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full ``(B, ...)`` ids -> ``(B/(q*d), ..., H/q)``."""
        ids = rows_chunk(ids, self.grid.k, self.grid.depth)  # this depth layer's batch
        local = ids - self.vocab_start
        out_of_block = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(out_of_block, 0), self.grid.replicated(self.weight))
        out = out.masked_fill(out_of_block.unsqueeze(-1), 0.0)  # (B/d, ..., H/q), partial over vocab blocks
        check_divisible(out.shape[0], self.grid.q, "batch per depth layer", "the 2D grid side q")
        return reduce_scatter_along_dim(out, 0, self.grid.col)


class VocabParallelLMHead2D(nn.Module):
    """Output projection sharing :class:`VocabParallelEmbedding2D`'s weight layout:
    ``(b, ..., H/q)`` -> logits ``(b, ..., V/q)`` of vocabulary block ``j``."""

    def __init__(self, linear: nn.Linear, grid: Grid2D):
        super().__init__()
        if linear.bias is not None:
            raise NotImplementedError("a vocab-parallel LM head with a bias is not supported; use bias=False")
        check_divisible(linear.out_features, grid.q, "vocab_size", "the 2D grid side q")
        self.grid = grid
        self.weight = nn.Parameter(_block(linear.weight, grid, (0, 1), (grid.i, grid.j)))  # (V/q, H/q)

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid2D) -> VocabParallelLMHead2D:
        """Copy and split ``linear`` (``(V, H)`` weight, no bias)."""
        return cls(linear, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial logits over the full vocabulary, reduce-scattered over ``row`` to block ``j``."""
        w = all_gather_along_dim(self.grid.replicated(self.weight), 0, self.grid.col)  # (V, H/q)
        return reduce_scatter_along_dim(F.linear(x, w), -1, self.grid.row)


def split_input_2d(x: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """This rank's block ``(B/(q*d), ..., H/q)`` of a replicated ``(B, ..., H)`` (no communication)."""
    x = rows_chunk(x, grid.row_block, grid.row_blocks)
    check_divisible(x.shape[-1], grid.q, "hidden size", "the 2D grid side q")
    return x.chunk(grid.q, -1)[grid.j]


def gather_output_2d(x: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """The full ``(B, ..., H)`` from every rank's block (all-gathers over ``row`` then the batch)."""
    return gather_along_dim(gather_along_dim(x, -1, grid.row), 0, grid.rows)


def cross_entropy_2d(
    logits: torch.Tensor,
    target: torch.Tensor,
    grid: Grid2D,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
):
    """Loss of ``(b, ..., V/q)`` logits against the full ``(B, ...)`` target (dense mean), as
    ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``)."""
    check_targets(target, logits.shape[-1] * grid.q, ignore_index)  # the full target: every rank agrees
    target = rows_chunk(target, grid.row_block, grid.row_blocks)
    start = grid.j * logits.shape[-1]
    return vocab_parallel_cross_entropy(
        logits, target, grid.row, start, (grid.rows,), reduction, ignore_index, label_smoothing
    )


def hidden_layout_2d(grid: Grid2D) -> HiddenLayout:
    """Where 2D (or 2.5D) activations hold the batch and the hidden size, for the vision styles:
    hidden block ``j``, a hidden tensor's block sharded over ``col`` (replicated over ``dep``),
    batch block ``k*q + i``."""
    mode = "2.5d" if grid.depth > 1 else "2d"
    gather = functools.partial(gather_output_2d, grid=grid)
    return HiddenLayout(mode, grid.q, grid.j, (grid.col,), grid.row_block, grid.row_blocks, grid.replicated, gather)


def layer_factories(grid: Grid2D) -> dict:
    """Style -> builder of the 2D layer on ``grid`` (shared with 2.5D)."""
    return {
        Style.COL: lambda m: Linear2D(m, grid),
        Style.ROW: lambda m: Linear2D(m, grid),
        Style.NORM: lambda m: LayerNorm2D(m, grid),
        Style.EMBED: lambda m: Embedding2D(m, grid),
        Style.POS_EMBED: lambda m: Embedding2D(m, grid, split_rows=False),
        Style.VOCAB_EMBED: lambda m: VocabParallelEmbedding2D(m, grid),
        Style.LM_HEAD: lambda m: VocabParallelLMHead2D(m, grid),
    } | vision_factories(hidden_layout_2d(grid))


def share_input_gather(model: nn.Module, plan: dict, grid: Grid2D) -> None:
    """[Note: one input gather for q, k and v]
    q, k and v are three linears of the same input; each would all-gather it over ``row``. For
    each ``HEADS`` module with ``COL`` ``Linear2D`` children, one pre-hook gathers the module's input once
    and the children skip theirs. The module's input must feed only those projections (true of
    the GPT attention); only the hidden dimension changes, so ``B, T = x.shape[:2]`` still holds."""
    styles = {name: style for name, _, style in resolve_plan(model, plan)}
    for name, module in model.named_modules():
        children = [
            m for c, m in module.named_children() if isinstance(m, Linear2D) and styles.get(f"{name}.{c}") == Style.COL
        ]
        if styles.get(name) != Style.HEADS or not children:
            continue
        for m in children:
            m.input_gathered = True
        module.register_forward_pre_hook(lambda mod, args: (all_gather_along_dim(args[0], -1, grid.row), *args[1:]))


def apply_2d(model: nn.Module, layout: Layout2D | Mesh, plan: dict | None = None, axis: str = "tp") -> nn.Module:
    """Convert ``model`` in place (default plan :func:`gpt_plan`); ``layout`` is a
    ``Mesh.layout("2d")`` or a ``Mesh`` whose ``axis`` is checked (``q^2``) and laid out."""
    if isinstance(layout, Mesh):
        grid_side(layout.size(axis), 2, "2d")
        layout = layout.layout("2d", axis)
    grid, plan = Grid2D.of(layout), plan or gpt_plan("2d")
    with torch.profiler.record_function("colossal.tensor_parallel::apply_2d"):
        convert_model(model, plan, layer_factories(grid), grid.q, "2d")
        share_input_gather(model, plan, grid)
        return model
