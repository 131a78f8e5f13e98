"""Vision inputs and heads for the modes that split the activations (2D, 2.5D, 3D): a convolutional
patch projection, a module's bare hidden-size parameters (a class token, learned positions), and a
replicated head fed by split activations.

[Note: the activation layout a vision embedding must produce]
2D/2.5D/3D layers take ``(b, T, H/q)`` blocks: ``b`` one of the mode's batch blocks, ``H/q`` one
hidden block (:class:`HiddenLayout` says which, per mode). A text model gets that layout from a
hidden-split ``nn.Embedding`` (``Style.EMBED``). A vision transformer builds its first activations
from a ``Conv2d`` whose kernel equals its stride (one output vector per patch), then concatenates a
class token and adds position embeddings held as bare ``nn.Parameter`` s. Splitting the
convolution's *output channels* as the hidden size is split, and its input images by batch block,
gives exactly ``(b, H/q, h, w)``, which the model's own ``flatten(2).transpose(1, 2)`` turns into
``(b, T, H/q)``; the class token and positions split along their last (hidden) dimension then
concatenate and add blockwise. Every weight is stored as ``1/P`` of the dense one (``P`` the
ranks that hold distinct blocks) and gathered over the ranks that share its hidden block, whose
backward (a reduce-scatter) sums their batch blocks' gradients, as the modes' LayerNorm vectors do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from colossal.tensor_parallel._ops import gather_param, group_size, rows_chunk, shard_param
from colossal.tensor_parallel.plan import Style
from colossal.tensor_parallel.validation import check_divisible

__all__ = ["HiddenLayout", "PatchEmbedding", "VisionEmbedding", "GatherInput", "vision_factories"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclasses.dataclass(frozen=True)
class HiddenLayout:
    """Where a mode puts the batch and the hidden size of the activations entering its first
    layer, and how it stores a tensor over the hidden size (built by each mode:
    :func:`~colossal.tensor_parallel.two_d.hidden_layout_2d`,
    :func:`~colossal.tensor_parallel.three_d.hidden_layout_3d`)."""

    mode: str
    """``"2d"``, ``"2.5d"`` or ``"3d"`` (for messages)."""
    q: int
    """Number of hidden blocks (the grid side)."""
    block: int
    """This rank's hidden block."""
    groups: tuple[ProcessGroup, ...]
    """The ranks holding the same hidden block (they split the batch): a hidden tensor's block is
    sharded over them and gathered back (innermost first)."""
    row_block: int
    """This rank's batch block."""
    row_blocks: int
    """Number of batch blocks."""
    replicate: Callable[[torch.Tensor], torch.Tensor]
    """Applied to a stored shard before its gather: identity, or (2.5D) a copy whose gradient is
    summed over the depth group the shard is replicated on."""
    gather: Callable[[torch.Tensor], torch.Tensor]
    """The mode's gather of ``(b, ..., H/q)`` activations into the full ``(B, ..., H)`` (its backward
    keeps each rank's block: for a consumer that every rank runs on the whole batch)."""

    @property
    def shards(self) -> int:
        """Distinct pieces a hidden tensor is stored in (``q`` blocks times the ranks sharing one)."""
        n = self.q
        for g in self.groups:
            n *= group_size(g)
        return n

    def check(self, size: int, what: str) -> None:
        """``ValueError`` unless a hidden size ``size`` (named ``what``) splits into :attr:`shards`."""
        check_divisible(size, self.shards, what, f"the {self.mode} shards of a hidden tensor")

    def shard(self, full: torch.Tensor, dim: int) -> nn.Parameter:
        """This rank's stored piece of ``full`` split along ``dim`` (no communication)."""
        block = full.detach().chunk(self.q, dim)[self.block]
        return nn.Parameter(shard_param(block, self.groups, dim).clone())

    def gathered(self, p: torch.Tensor, dim: int) -> torch.Tensor:
        """Hidden block :attr:`block` of a stored piece (all-gathers over :attr:`groups`)."""
        return gather_param(self.replicate(p), self.groups, dim)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's batch block of a replicated ``(B, ...)`` input."""
        return rows_chunk(x, self.row_block, self.row_blocks, "batch (images)")


class PatchEmbedding(nn.Module):
    """A patch projection (``nn.Conv1d/2d/3d``, any kernel and stride) whose output channels are the
    hidden size: full ``(B, C, *spatial)`` input -> ``(b, H/q, *spatial')`` of this rank's batch
    block and hidden block (``[Note: the activation layout a vision embedding must produce]``);
    under a ``VISION_EMBED`` module its input is already the batch block."""

    def __init__(self, conv: nn.Module, layout: HiddenLayout):
        super().__init__()
        if not isinstance(conv, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            raise TypeError(f"Style.PATCH_EMBED needs an nn.Conv1d/2d/3d, got {type(conv).__name__}")
        if conv.groups != 1 or conv.padding_mode != "zeros":
            raise NotImplementedError(
                f"Style.PATCH_EMBED supports groups=1 and padding_mode='zeros'; got groups={conv.groups}, "
                f"padding_mode={conv.padding_mode!r}"
            )
        layout.check(conv.out_channels, "out_channels (hidden size)")
        self.layout = layout
        self.conv_fn = _CONV[conv.weight.dim() - 2]  # F.conv1d / conv2d / conv3d
        self.options = {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation}
        """The dense convolution's geometry (kept as it was)."""
        self.split_rows = True
        """Cut the input to this rank's batch block (``False`` under a ``VISION_EMBED`` module, which did)."""
        self.weight = layout.shard(conv.weight, 0)  # (H/shards, C, *kernel)
        self.bias = None if conv.bias is None else layout.shard(conv.bias, 0)

    @classmethod
    def from_dense(cls, conv: nn.Module, layout: HiddenLayout) -> PatchEmbedding:
        """Copy and split ``conv``."""
        return cls(conv, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, ...)`` -> ``(b, H/q, ...)``."""
        with torch.profiler.record_function("colossal.tensor_parallel::patch_embedding"):
            if self.split_rows:
                x = self.layout.rows(x)  # checked before any collective: every rank sees the same B
            w = self.layout.gathered(self.weight, 0)  # (H/q, C, *kernel)
            b = None if self.bias is None else self.layout.gathered(self.bias, 0)
            return self.conv_fn(x, w, b, **self.options)


class VisionEmbedding:
    """In-place conversion of the module that turns the images into the first activations (a ViT's
    embeddings: a patch projection plus a class token and learned positions of its own).

    Its first input, the whole ``(B, ...)`` batch of images, is cut to this rank's batch block
    before its forward (so every size it reads from the images is the block's; its
    :class:`PatchEmbedding` children then take their input as it comes). Its *own* parameters (not
    its submodules'), each a tensor over the hidden size in its last dimension, are stored split
    (:meth:`HiddenLayout.shard`, under their own names, so state dicts keep them) and, for its
    forward only, replaced by their gathered hidden block ``(..., H/q)``. The swap goes through the
    module's ``_parameters`` (as ``torch.func.functional_call`` does); a forward hook with
    ``always_call`` puts the stored pieces back even when the forward raises."""

    def __init__(self, module: nn.Module, layout: HiddenLayout):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for n in names:
            layout.check(getattr(module, n).shape[-1], f"{type(module).__name__}.{n}.shape[-1] (hidden size)")
        self.layout = layout
        self.pieces = {n: layout.shard(getattr(module, n), -1) for n in names}
        """Parameter name -> this rank's stored piece (built before the module is touched)."""

    def __call__(self, module: nn.Module) -> None:
        """Put the pieces on ``module``, install the split / gather / restore hooks."""
        for n, piece in self.pieces.items():
            setattr(module, n, piece)
        for m in module.modules():
            if isinstance(m, PatchEmbedding):
                m.split_rows = False  # the images arrive already split
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._restore, always_call=True)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict):
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"Style.VISION_EMBED: {type(module).__name__} must get the images as its first argument")
        args = (self.layout.rows(args[0]), *args[1:])  # before any collective: every rank sees the same B
        for n, piece in self.pieces.items():
            module._parameters[n] = self.layout.gathered(piece, -1)  # (..., H/q) for this forward
        return args, kwargs

    def _restore(self, module: nn.Module, args, output):
        module._parameters.update(self.pieces)


class GatherInput:
    """In-place conversion of a module fed by split activations that runs replicated on every rank
    (a classifier on the class token): a forward pre-hook gathers its first input into the full
    ``(B, ..., H)``; its parameters stay whole, its output is the whole batch's on every rank."""

    def __init__(self, module: nn.Module, layout: HiddenLayout):
        self.layout = layout

    def __call__(self, module: nn.Module) -> None:
        """Install the gather on ``module``."""
        module.register_forward_pre_hook(lambda mod, args: (self.layout.gather(args[0]), *args[1:]))


def vision_factories(layout: HiddenLayout) -> dict:
    """Style -> builder for ``PATCH_EMBED``, ``VISION_EMBED`` and ``GATHER`` on ``layout``."""
    return {
        Style.PATCH_EMBED: lambda m: PatchEmbedding(m, layout),
        Style.VISION_EMBED: lambda m: VisionEmbedding(m, layout),
        Style.GATHER: lambda m: GatherInput(m, layout),
    }
