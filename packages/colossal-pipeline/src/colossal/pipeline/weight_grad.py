"""Split backward for zero-bubble schedules: input gradients now, weight gradients later.

While a :class:`WeightGradStore` captures, every patched ``nn.Linear`` computes only the gradient
of its input in backward and queues ``(input, grad_output)``; :meth:`WeightGradStore.flush` later
computes ``grad_W = grad_out^T x`` and ``grad_b = sum(grad_out)`` with the same products autograd
would have used, and accumulates them into ``.grad``. Linear layers hold nearly all of a
transformer's weight-gradient work; the few other parameters (norms, embeddings) get theirs in
the input-gradient pass. This is how the zero-bubble paper's own implementation splits it.

[Note: only a plain Linear is split]
The deferred function computes ``x @ W^T + b`` itself, so it may stand in only for a module whose
forward is exactly that: ``nn.Linear.forward`` on the module's own ``weight`` and ``bias``
leaves. A subclass with its own ``forward`` (a masked or scaled weight, a LoRA adapter), a module
with an instance-level ``forward``, a ``weight`` that is not a parameter (``torch.nn.utils.prune``
recomputes it in a pre-hook) and a parametrized module
(``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, whose ``weight`` is computed
from ``original0/1`` on every access) keep their own forward; autograd gives their weight
gradients in the input-gradient pass, exactly as in plain PyTorch, at the cost of less bubble
removed. :attr:`WeightGradStore.kept` names them.

[Note: deferred gradients through autograd]
:meth:`WeightGradStore.flush` hands the deferred gradients to ``torch.autograd.backward`` on the
parameters themselves (a leaf's backward is its ``AccumulateGrad``) rather than adding them to
``.grad`` by hand: the parameters' post-accumulate-grad hooks then run, as they do for every other
gradient, so an engine that reduces gradients from those hooks at the end of a backward pass
(ZeRO's reducer over dp) sees the weight gradients too. Added by hand they were never reduced,
and a ``.grad`` that is a view of ZeRO's flat buffer refused the in-place add.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["WeightGradStore"]


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store, module):  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.store, ctx.module = bias is not None, store, module
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        x, weight = ctx.saved_tensors
        store = ctx.store
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        wants = ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2])
        if store.queue is not None and wants:
            store.queue.append((x, grad_out, ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.module))
            return grad_x, None, None, None, None
        gw, gb = _weight_grads(x, grad_out, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        return grad_x, gw, gb, None, None


def _weight_grads(x, grad_out, want_w, want_b):
    go = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out)
    gw = go.t() @ x.reshape(-1, x.shape[-1]) if want_w else None  # (out, in)
    gb = go.sum(0) if want_b else None  # (out,)
    return gw, gb


class WeightGradStore:
    """Queues of deferred linear weight gradients, one per (micro-batch, chunk) key."""

    def __init__(self) -> None:
        self.queue: list | None = None
        """The queue being filled (``None``: backward computes weight gradients at once)."""
        self._queues: dict[object, list] = {}
        self.kept: list[str] = []
        """Qualified names of the ``nn.Linear`` modules left unsplit (see [Note: only a plain
        Linear is split]): their weight gradients come in the input-gradient pass."""

    def patch(self, module: nn.Module, prefix: str = "") -> int:
        """Route every plain ``nn.Linear`` under ``module`` through the deferring function; returns
        how many were patched. Outside :meth:`capture` they behave exactly as before. Linear
        modules whose forward is not ``nn.Linear.forward`` on their own leaves are left alone and
        listed in :attr:`kept` under ``prefix`` + their name."""
        n = 0
        for name, mod in module.named_modules(prefix=prefix):
            if not isinstance(mod, nn.Linear) or getattr(mod, "_colossal_deferred", False):
                continue
            if not _splittable(mod):
                if name not in self.kept:
                    self.kept.append(name)
                continue
            mod.forward = types.MethodType(_deferred_forward, mod)
            mod._colossal_deferred, mod._colossal_store = True, self
            n += 1
        return n

    @contextmanager
    def capture(self, key: object) -> Iterator[None]:
        """Defer the weight gradients of every backward run inside to :meth:`flush` of ``key``."""
        if key in self._queues:
            raise RuntimeError(f"weight gradients of {key!r} are already pending")
        self.queue = self._queues[key] = []
        try:
            yield
        finally:
            self.queue = None

    def flush(self, key: object) -> None:
        """Compute and accumulate the weight gradients deferred under ``key``: one autograd pass
        over the parameters (``[Note: deferred gradients through autograd]``)."""
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for x, grad_out, want_w, want_b, mod in self._queues.pop(key):
                gw, gb = _weight_grads(x, grad_out, want_w, want_b and mod.bias is not None)
                for param, g in ((mod.weight, gw), (mod.bias, gb)):
                    if g is not None:
                        seen = grads.get(id(param))
                        grads[id(param)] = (param, g if seen is None else seen[1] + g)
        if grads:
            params, values = zip(*grads.values(), strict=True)
            torch.autograd.backward(list(params), list(values))

    @property
    def pending(self) -> int:
        """Number of keys whose weight gradients are still deferred."""
        return len(self._queues)


def _splittable(mod: nn.Linear) -> bool:
    """Whether ``mod``'s forward is exactly ``F.linear(x, mod.weight, mod.bias)`` on leaf
    parameters, which the deferring function reproduces ([Note: only a plain Linear is split])."""
    if type(mod).forward is not nn.Linear.forward or "forward" in mod.__dict__:
        return False
    if parametrize.is_parametrized(mod):
        return False
    return isinstance(mod.weight, nn.Parameter) and (mod.bias is None or isinstance(mod.bias, nn.Parameter))


def _deferred_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(x, self.weight, self.bias, self._colossal_store, self)
