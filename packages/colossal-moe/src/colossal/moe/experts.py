"""Experts stored as stacked weights and run as one grouped matmul over tokens sorted by expert.

[Note: grouped matmul on CPU]
Tokens arrive sorted by expert with per-expert counts; each expert multiplies its contiguous
segment. Measured on the 2-core machine (fp32, one thread, 4096 tokens, C=512, F=2048, 8 experts
with uneven counts, forward + backward of one ``(N, C) x (E, C, F)`` product):

======================================== =========
primitive                                  seconds
======================================== =========
``torch._grouped_mm(x, w, offs=...)``        0.32
a Python loop of ``x_e @ w[e]`` + ``cat``    0.51
``bmm`` over a padded ``(E, cap, C)``        0.51
one dense ``x @ w[0]`` (same FLOPs)          0.33
======================================== =========

``torch._grouped_mm`` runs at the speed of one dense matmul of the same FLOPs and takes its
gradients itself, so it is the path whenever it applies: float32/bfloat16/float16 with rows a
multiple of 16 bytes (its stride rule). Otherwise (float64, odd widths, an older torch, or a
device whose kernel refuses the dtype) the segment loop runs instead; both give the same numbers.
``torch.nested`` (jagged) tensors do not multiply a jagged batch by a per-segment weight.

[Note: expert blocks]
:class:`MLPExperts` does not run each weight over all ``M`` rows at once: it walks runs of
consecutive experts whose ``(rows, F)`` activation is at most :data:`BLOCK_BYTES` (4 MiB; an
expert with more rows forms a run alone) and runs the whole MLP of one run (grouped matmul,
bias, activation, grouped matmul) before the next, in one autograd function that saves each
run's activations and, in backward, frees them run by run. A run of one expert is a plain
``addmm`` (bias fused) written straight into the output. Why: glibc serves allocations of 32 MiB
and more with a fresh ``mmap`` and returns them on free, so every ``(M, F)`` tensor of that size
(``M`` = 4096 tokens x top-2, ``F`` = 2048, fp32 is 64 MiB) cost a page fault per 4 KiB on every
step: 25k (top-1) and 69k (top-2) faults per forward+backward on one rank, 60-300 ms of system
time against DeepSpeed's zero, whose per-expert ``nn.Linear`` chunks stay small. Blocks also keep
the activation pass on data the matmul just wrote. The weight gradients stay one
``(E, C, F)`` tensor each (two faulting allocations per step when they reach 32 MiB).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from colossal.moe.config import MoEConfig

__all__ = ["BLOCK_BYTES", "grouped_mm", "expert_blocks", "MLPExperts", "SwiGLUExperts", "build_experts"]

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REFUSED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) whose kernel raised once


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with its backward written out: the built-in one rejects the
    zero-stride gradients that ``y.sum().backward()`` produces, and its output is a plain tensor
    (no view), so a bias can be added to it in place."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        gx = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        gw = torch._grouped_mm(x.t(), grad, offs=offs) if ctx.needs_input_grad[1] else None  # (G, K, N)
        return gx, gw, None


def _grouped_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in _GROUPED_DTYPES or x.dtype != w.dtype:
        return False
    if (x.device.type, x.dtype) in _REFUSED:
        return False
    align = 16 // x.element_size()
    return x.shape[1] % align == 0 and w.shape[2] % align == 0


def _segment_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    # Empty segments multiply too, so every expert's weight joins the graph (a zero gradient, not None).
    return torch.cat([seg @ w[e] for e, seg in enumerate(x.split(counts))])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (M, K) sorted by group, ``w`` (G, K, N), ``counts`` (G,) rows per group -> (M, N).

    Row block ``g`` of ``x`` is multiplied by ``w[g]``. Differentiable in ``x`` and ``w``; see
    ``[Note: grouped matmul on CPU]`` for the kernel chosen.
    """
    if x.shape[0] != int(counts.sum()):
        raise ValueError(f"grouped_mm: x has {x.shape[0]} rows but counts sum to {int(counts.sum())}")
    if _grouped_applies(x, w):
        offs = counts.cumsum(0).to(device=x.device, dtype=torch.int32)
        try:
            return _GroupedMM.apply(x.contiguous(), w, offs)
        except RuntimeError:  # a device/dtype this torch build has no kernel for
            _REFUSED.add((x.device.type, x.dtype))
    return _segment_loop(x, w, counts.tolist())


class _SegmentBias(torch.autograd.Function):
    """``h[rows of expert e] += b[e]`` in place, without materialising a per-row ``(M, F)`` bias.

    ``h`` is a fresh grouped-matmul output that nothing saved, so adding in place is safe;
    the backward sums the gradient per segment (one ``index_add``)."""

    @staticmethod
    def forward(ctx, h, b, counts):
        ctx.save_for_backward(counts)
        ctx.mark_dirty(h)
        with torch.no_grad():
            for e, seg in enumerate(h.split(counts.tolist())):
                seg.add_(b[e])
        return h

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        rows = torch.arange(counts.numel(), device=grad.device).repeat_interleave(counts.to(grad.device))
        return grad, grad.new_zeros(counts.numel(), grad.shape[1]).index_add_(0, rows, grad), None


BLOCK_BYTES = 4 << 20
"""Target size of one row block's ``(rows, F)`` activation in :class:`MLPExperts` (see
``[Note: expert blocks]``)."""


def expert_blocks(counts: list[int], row_bytes: int, block_bytes: int | None = None) -> list[tuple[int, int, int, int]]:
    """Split experts ``0..G-1`` with ``counts[g]`` rows each into runs of consecutive experts:
    ``(first expert, end expert, first row, end row)``; a run holds at most ``block_bytes`` (default
    :data:`BLOCK_BYTES`) of rows of ``row_bytes`` each, or one expert that alone holds more.
    Every expert is in exactly one run (empty experts join their neighbours)."""
    limit = max(1, (BLOCK_BYTES if block_bytes is None else block_bytes) // max(1, row_bytes))
    blocks, e0, r0, rows = [], 0, 0, 0
    for g, c in enumerate(counts):
        if rows and rows + c > limit:
            blocks.append((e0, g, r0, r0 + rows))
            e0, r0, rows = g, r0 + rows, 0
        rows += c
    blocks.append((e0, len(counts), r0, r0 + rows))
    return blocks


_ACTIVATION_GRADS = {
    "gelu_tanh": lambda g, h, a: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
    "gelu": lambda g, h, a: torch.ops.aten.gelu_backward(g, h),
    "relu": lambda g, h, a: torch.ops.aten.threshold_backward(g, a, 0),
    "silu": lambda g, h, a: torch.ops.aten.silu_backward(g, h),
}


def _block_mm(x, w, counts, bias=None, out=None, grouped=True):
    """``x`` (R, K) rows of the experts of ``w`` (g, K, N) with ``counts`` (g,) rows each, plus
    ``bias[e]`` (g, N) per row of expert ``e``; written into ``out`` (R, N) when given."""
    if w.shape[0] == 1:  # one expert: a plain (add)mm, bias fused, straight into ``out``
        if bias is None:
            return torch.mm(x, w[0], out=out) if out is not None else torch.mm(x, w[0])
        return torch.addmm(bias[0], x, w[0], out=out) if out is not None else torch.addmm(bias[0], x, w[0])
    if grouped:
        offs = torch.tensor(counts).cumsum(0).to(device=x.device, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offs)
    else:
        y = torch.cat([seg @ w[e] for e, seg in enumerate(x.split(counts))])
    if bias is not None:
        for e, seg in enumerate(y.split(counts)):
            seg.add_(bias[e])
    return y if out is None else out.copy_(y)


def _block_wgrad(x, g, counts, out, grouped=True):
    """Weight gradients ``out[e] = x_e^T g_e`` (``out`` (G, K, N)) of the experts' row segments."""
    if out.shape[0] == 1:
        torch.mm(x.t(), g, out=out[0])
    elif grouped:
        offs = torch.tensor(counts).cumsum(0).to(device=x.device, dtype=torch.int32)
        out.copy_(torch._grouped_mm(x.t(), g, offs=offs))
    else:
        for e, (xs, gs) in enumerate(zip(x.split(counts), g.split(counts))):
            torch.mm(xs.t(), gs, out=out[e])


def _segment_sums(g, counts, out):
    """``out[e]`` = sum of the rows of expert ``e`` in ``g``."""
    for e, seg in enumerate(g.split(counts)):
        torch.sum(seg, 0, out=out[e])


class _BlockedMLP(torch.autograd.Function):
    """``act(x W_in[e] + b_in[e]) W_out[e] + b_out[e]`` for rows sorted by expert, one block of
    experts at a time (``[Note: expert blocks]``); activations are saved per block."""

    @staticmethod
    def _run(x, w_in, b_in, w_out, b_out, counts, activation, grouped):
        f = w_in.shape[2]
        blocks = expert_blocks(counts, f * x.element_size()) if grouped else _per_expert(counts)
        act = _ACTIVATIONS[activation]
        y = x.new_empty(x.shape[0], w_out.shape[2])
        saved = []
        for e0, e1, r0, r1 in blocks:
            c, xb = counts[e0:e1], x[r0:r1]
            bi = None if b_in is None else b_in[e0:e1]
            bo = None if b_out is None else b_out[e0:e1]
            h = _block_mm(xb, w_in[e0:e1], c, bi, grouped=grouped)  # (rows, F)
            a = act(h)
            _block_mm(a, w_out[e0:e1], c, bo, out=y[r0:r1], grouped=grouped)
            saved.append((h, a))
        return y, blocks, saved

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, counts, activation):
        grouped = _grouped_applies(x, w_in) and _grouped_applies(x.new_empty(0, w_in.shape[2]), w_out)
        if grouped:
            try:
                y, blocks, saved = _BlockedMLP._run(x, w_in, b_in, w_out, b_out, counts, activation, True)
            except RuntimeError:  # a device/dtype this torch build has no grouped kernel for
                _REFUSED.add((x.device.type, x.dtype))
                grouped = False
        if not grouped:
            y, blocks, saved = _BlockedMLP._run(x, w_in, b_in, w_out, b_out, counts, activation, False)
        ctx.save_for_backward(x, w_in, w_out)
        ctx.blocks, ctx.counts, ctx.saved, ctx.grouped = blocks, counts, saved, grouped
        ctx.activation = activation
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w_in, w_out = ctx.saved_tensors
        counts, grouped, act_grad = ctx.counts, ctx.grouped, _ACTIVATION_GRADS[ctx.activation]
        need_x, need_win, need_bin, need_wout, need_bout = ctx.needs_input_grad[:5]
        gy = gy.contiguous()
        gx = x.new_empty(x.shape) if need_x else None
        gw_in = torch.empty_like(w_in) if need_win else None
        gw_out = torch.empty_like(w_out) if need_wout else None
        e, f = w_in.shape[0], w_in.shape[2]
        gb_in = w_in.new_empty(e, f) if need_bin else None
        gb_out = w_out.new_empty(e, w_out.shape[2]) if need_bout else None
        for i, (e0, e1, r0, r1) in enumerate(ctx.blocks):
            h, a = ctx.saved[i]
            ctx.saved[i] = None  # free each block's activations as soon as they are used
            c, gyb = counts[e0:e1], gy[r0:r1]
            if need_wout:
                _block_wgrad(a, gyb, c, gw_out[e0:e1], grouped)
            if need_bout:
                _segment_sums(gyb, c, gb_out[e0:e1])
            gh = act_grad(_block_mm(gyb, w_out[e0:e1].transpose(1, 2), c, grouped=grouped), h, a)
            del h, a
            if need_win:
                _block_wgrad(x[r0:r1], gh, c, gw_in[e0:e1], grouped)
            if need_bin:
                _segment_sums(gh, c, gb_in[e0:e1])
            if need_x:
                _block_mm(gh, w_in[e0:e1].transpose(1, 2), c, out=gx[r0:r1], grouped=grouped)
        ctx.saved = None
        return gx, gw_in, gb_in, gw_out, gb_out, None, None


def _per_expert(counts: list[int]) -> list[tuple[int, int, int, int]]:
    ends = list(itertools.accumulate(counts, initial=0))
    return [(g, g + 1, ends[g], ends[g + 1]) for g in range(len(counts))]


def _add_bias(h: torch.Tensor, b: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """``h`` (M, N) rows sorted by expert plus ``b[expert of row]``; ``h`` itself without bias."""
    return h if b is None else _SegmentBias.apply(h, b, counts)


def _gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


_ACTIVATIONS = {  # named functions, not lambdas: a module holding one pickles (torch.save(model))
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class MLPExperts(nn.Module):
    """``num_local`` experts ``act(x W_in + b_in) W_out + b_out`` with stacked weights.

    ``w_in`` (E_local, C, F), ``b_in`` (E_local, F), ``w_out`` (E_local, F, C), ``b_out`` (E_local, C).
    """

    def __init__(self, config: MoEConfig, num_local: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        c, f = config.hidden, config.ffn_hidden
        self.num_local = num_local
        self.activation_name = config.activation
        self.activation = _ACTIVATIONS[config.activation]
        self.w_in = nn.Parameter(torch.empty(num_local, c, f, device=device))
        self.w_out = nn.Parameter(torch.empty(num_local, f, c, device=device))
        self.b_in = nn.Parameter(torch.empty(num_local, f, device=device)) if config.bias else None
        self.b_out = nn.Parameter(torch.empty(num_local, c, device=device)) if config.bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert initialised like ``nn.Linear`` of its shape (uniform +-1/sqrt(fan_in))."""
        for w, b in ((self.w_in, self.b_in), (self.w_out, self.b_out)):
            bound = 1.0 / math.sqrt(w.shape[1])
            w.uniform_(-bound, bound)
            if b is not None:
                b.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (M, C) sorted by local expert, ``counts`` (E_local,) -> (M, C)."""
        c = counts.tolist()
        if x.shape[0] != sum(c):
            raise ValueError(f"MLPExperts: x has {x.shape[0]} rows but counts sum to {sum(c)}")
        return _BlockedMLP.apply(x.contiguous(), self.w_in, self.b_in, self.w_out, self.b_out, c, self.activation_name)


class SwiGLUExperts(nn.Module):
    """``num_local`` experts ``(silu(x W_gate) * (x W_in)) W_out`` (Mixtral), no biases.

    ``w_gate`` and ``w_in`` (E_local, C, F), ``w_out`` (E_local, F, C).
    """

    def __init__(self, config: MoEConfig, num_local: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        c, f = config.hidden, config.ffn_hidden
        self.num_local = num_local
        self.w_gate = nn.Parameter(torch.empty(num_local, c, f, device=device))
        self.w_in = nn.Parameter(torch.empty(num_local, c, f, device=device))
        self.w_out = nn.Parameter(torch.empty(num_local, f, c, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert initialised like ``nn.Linear`` of its shape (uniform +-1/sqrt(fan_in))."""
        for w in (self.w_gate, self.w_in, self.w_out):
            bound = 1.0 / math.sqrt(w.shape[1])
            w.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (M, C) sorted by local expert, ``counts`` (E_local,) -> (M, C)."""
        h = F.silu(grouped_mm(x, self.w_gate, counts)) * grouped_mm(x, self.w_in, counts)  # (M, F)
        return grouped_mm(h, self.w_out, counts)


def build_experts(config: MoEConfig, num_local: int, device: torch.device | str | None = None) -> nn.Module:
    """The expert module ``config.expert`` names, holding ``num_local`` experts."""
    cls = MLPExperts if config.expert == "mlp" else SwiGLUExperts
    return cls(config, num_local, device=device)
