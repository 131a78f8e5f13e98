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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from colossal.moe.config import MoEConfig

__all__ = ["grouped_mm", "MLPExperts", "SwiGLUExperts", "build_experts"]

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


def _add_bias(h: torch.Tensor, b: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """``h`` (M, N) rows sorted by expert plus ``b[expert of row]``; ``h`` itself without bias."""
    return h if b is None else _SegmentBias.apply(h, b, counts)


_ACTIVATIONS = {
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
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
        h = _add_bias(grouped_mm(x, self.w_in, counts), self.b_in, counts)  # (M, F)
        return _add_bias(grouped_mm(self.activation(h), self.w_out, counts), self.b_out, counts)  # (M, C)


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
