"""1D tensor parallelism (Megatron-LM): weights split along one dimension over one group of ``P``.

Activations between blocks are replicated on every rank of the group. A column-parallel linear
(``COL``) splits its output features, a row-parallel one (``ROW``) its input features, so an MLP or
attention pair needs one all-reduce forward (after ``ROW``) and one backward (before ``COL``).
Communication and memory formulas: see the docs page, section "1D".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm import copy_to_group, gather_along_dim, reduce_from_group, split_along_dim
from colossal.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from colossal.tensor_parallel.plan import Style, convert_model, gpt_plan, resolve_plan
from colossal.tensor_parallel.validation import check_divisible

__all__ = [
    "Linear1D",
    "Embedding1D",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "LayerNorm1D",
    "split_input_1d",
    "gather_output_1d",
    "cross_entropy_1d",
    "apply_1d",
]


def _param(shape: tuple[int, ...]) -> nn.Parameter:
    """A fresh weight, ``N(0, 0.02)`` (use ``from_dense`` to convert a trained layer instead)."""
    return nn.Parameter(torch.randn(shape) * 0.02)


def _chunk(t: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    return t.detach().chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].clone()


class Linear1D(nn.Module):
    """Column- (``style="col"``: output features split) or row-parallel (``"row"``: input
    features split) linear layer over ``group``.

    ``col``: input replicated ``(..., in)`` -> output split ``(..., out/P)`` (or gathered with
    ``gather_output``). ``row``: input split ``(..., in/P)`` (or split here with
    ``input_is_parallel=False``) -> output replicated ``(..., out)``. The bias of a ``row`` layer is
    replicated; that of a ``col`` layer is split.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        style: str = "col",
        bias: bool = True,
        gather_output: bool = False,
        input_is_parallel: bool = True,
    ):
        super().__init__()
        if style not in ("col", "row"):
            raise ValueError(f"style must be 'col' or 'row', got {style!r}")
        p = dist.get_world_size(group)
        split_out, split_in = (p, 1) if style == "col" else (1, p)
        check_divisible(out_features, split_out, "out_features", "the 1D group size")
        check_divisible(in_features, split_in, "in_features", "the 1D group size")
        self.group, self.style = group, style
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.input_is_parallel = gather_output, input_is_parallel
        self.sync_input_grad = True
        """``col`` only: all-reduce the input gradient here (off when the parent already does it once
        for several projections of the same input, see :func:`apply_1d`)."""
        self.weight = _param((out_features // split_out, in_features // split_in))
        self.bias = nn.Parameter(torch.zeros(out_features // split_out)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: ProcessGroup, style: str = "col", **kwargs) -> Linear1D:
        """Copy and split ``linear``'s weights."""
        new = cls(linear.in_features, linear.out_features, group, style, bias=linear.bias is not None, **kwargs)
        with torch.no_grad():
            new.weight.copy_(_chunk(linear.weight, group, 0 if style == "col" else 1))
            if linear.bias is not None:
                new.bias.copy_(_chunk(linear.bias, group, 0) if style == "col" else linear.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for the layouts."""
        with torch.profiler.record_function(f"colossal.tensor_parallel::linear1d_{self.style}"):
            if self.style == "col":
                x = copy_to_group(x, self.group) if self.sync_input_grad else x
                y = F.linear(x, self.weight, self.bias)  # (..., out/P)
                return gather_along_dim(y, -1, self.group) if self.gather_output else y
            if not self.input_is_parallel:
                x = split_along_dim(x, -1, self.group)  # (..., in/P)
            y = reduce_from_group(F.linear(x, self.weight), self.group)  # (..., out)
            return y if self.bias is None else y + self.bias


class Embedding1D(nn.Module):
    """Embedding split along the hidden size; the output is gathered (replicated ``(..., H)``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup):
        super().__init__()
        check_divisible(embedding_dim, dist.get_world_size(group), "embedding_dim", "the 1D group size")
        self.group = group
        self.weight = _param((num_embeddings, embedding_dim // dist.get_world_size(group)))

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: ProcessGroup) -> Embedding1D:
        """Copy and split ``emb``'s weight."""
        new = cls(emb.num_embeddings, emb.embedding_dim, group)
        with torch.no_grad():
            new.weight.copy_(_chunk(emb.weight, group, 1))
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids (...)`` -> ``(..., H)`` replicated."""
        return gather_along_dim(F.embedding(ids, self.weight), -1, self.group)


class VocabParallelEmbedding1D(nn.Module):
    """Embedding split along the vocabulary: rank ``r`` holds rows ``[r*V/P, (r+1)*V/P)``; ids
    outside give zeros and one all-reduce sums the slices (output replicated ``(..., H)``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup):
        super().__init__()
        p = dist.get_world_size(group)
        check_divisible(num_embeddings, p, "num_embeddings (vocabulary)", "the 1D group size")
        self.group, self.num_embeddings = group, num_embeddings
        self.vocab_start = dist.get_rank(group) * num_embeddings // p
        """First vocabulary id held here."""
        self.weight = _param((num_embeddings // p, embedding_dim))

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: ProcessGroup) -> VocabParallelEmbedding1D:
        """Copy and split ``emb``'s weight."""
        new = cls(emb.num_embeddings, emb.embedding_dim, group)
        with torch.no_grad():
            new.weight.copy_(_chunk(emb.weight, group, 0))
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids (...)`` replicated -> ``(..., H)`` replicated."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.group)


class VocabParallelLMHead1D(nn.Module):
    """Output projection with the weight split along the vocabulary (same sharding as
    :class:`VocabParallelEmbedding1D`, so the two can share it): ``(..., H)`` replicated ->
    logits ``(..., V/P)``, rank ``r`` holding vocabulary slice ``r``. Use :func:`cross_entropy_1d`."""

    def __init__(self, in_features: int, vocab_size: int, group: ProcessGroup):
        super().__init__()
        check_divisible(vocab_size, dist.get_world_size(group), "vocab_size", "the 1D group size")
        self.group = group
        self.weight = _param((vocab_size // dist.get_world_size(group), in_features))

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: ProcessGroup) -> VocabParallelLMHead1D:
        """Copy and split ``linear`` (bias-free, ``(V, H)`` weight)."""
        if linear.bias is not None:
            raise NotImplementedError("a vocab-parallel LM head with a bias is not supported; use bias=False")
        new = cls(linear.in_features, linear.out_features, group)
        with torch.no_grad():
            new.weight.copy_(_chunk(linear.weight, group, 0))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` -> ``(..., V/P)``."""
        return F.linear(copy_to_group(x, self.group), self.weight)


class LayerNorm1D(nn.LayerNorm):
    """LayerNorm on replicated activations: a plain ``nn.LayerNorm`` (no communication)."""

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm) -> LayerNorm1D:
        """Copy ``ln``."""
        new = cls(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine, bias=ln.bias is not None)
        new.load_state_dict(ln.state_dict())
        return new


def split_input_1d(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """This rank's slice of a replicated tensor along ``dim`` (backward all-gathers)."""
    return split_along_dim(x, dim, group)


def gather_output_1d(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """All-gather a split tensor along ``dim`` (backward keeps this rank's slice)."""
    return gather_along_dim(x, dim, group)


def cross_entropy_1d(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
):
    """Loss of vocab-split logits ``(..., V/P)`` against replicated ``target (...)``, as
    ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``)."""
    start = dist.get_rank(group) * logits.shape[-1]
    return vocab_parallel_cross_entropy(logits, target, group, start, (), reduction, ignore_index, label_smoothing)


def _share_input_grad_sync(model: nn.Module, plan: dict, group: ProcessGroup) -> None:
    """[Note: one input all-reduce for q, k and v]
    Three column-parallel projections of the same input would all-reduce three input gradients
    (Megatron fuses QKV into one linear for this reason). For each ``HEADS`` module whose direct
    children are column-parallel, the all-reduce moves to one pre-hook on the module's input and
    the children skip theirs: the module's input must feed only those projections (true of the
    GPT attention and of any attention computing q, k, v from its input)."""
    for _name, module, style in resolve_plan(model, plan):
        cols = [m for m in module.children() if isinstance(m, Linear1D) and m.style == "col"]
        if style != Style.HEADS or not cols:
            continue
        for m in cols:
            m.sync_input_grad = False
        module.register_forward_pre_hook(lambda mod, args: (copy_to_group(args[0], group), *args[1:]))


def apply_1d(
    model: nn.Module, group: ProcessGroup, plan: dict | None = None, share_input_grad_sync: bool = True
) -> nn.Module:
    """Convert ``model`` in place with ``plan`` (default :func:`gpt_plan`) over ``group``.

    ``POS_EMBED``, ``NORM``, ``PATCH_EMBED``, ``VISION_EMBED`` and ``GATHER`` stay replicated
    (unchanged modules). ``share_input_grad_sync``: see
    ``[Note: one input all-reduce for q, k and v]`` in :func:`_share_input_grad_sync`."""
    factories = {
        Style.COL: lambda m: Linear1D.from_dense(m, group, "col"),
        Style.ROW: lambda m: Linear1D.from_dense(m, group, "row"),
        Style.EMBED: lambda m: Embedding1D.from_dense(m, group),
        Style.VOCAB_EMBED: lambda m: VocabParallelEmbedding1D.from_dense(m, group),
        Style.LM_HEAD: lambda m: VocabParallelLMHead1D.from_dense(m, group),
        Style.POS_EMBED: lambda m: None,
        Style.NORM: lambda m: None,
        Style.PATCH_EMBED: lambda m: None,  # 1D activations are whole outside the split linears
        Style.VISION_EMBED: lambda m: None,
        Style.GATHER: lambda m: None,
    }
    plan = plan or gpt_plan("1d")
    with torch.profiler.record_function("colossal.tensor_parallel::apply_1d"):
        convert_model(model, plan, factories, dist.get_world_size(group), "1d")
        if share_input_grad_sync:
            _share_input_grad_sync(model, plan, group)
        return model
