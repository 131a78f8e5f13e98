"""Parity with plain PyTorch: relative-error checks and the single-process reference run.

[Note: per-tensor relative error]
Parallel engines sum the same products in another order (split matmuls, all-reduces, bucketed
reductions), so they differ from the dense run by a few ulps times the depth of the sums. The
checks here compare whole tensors, ``||got - want|| / ||want||``, against ``TOL = 1e-5``: a wide
margin above that noise and far below any real bug. Element-wise 1e-5 would be too strict for
Adam-family updates: an element whose gradient is near zero is divided by ``sqrt(v) + eps``,
which turns summation-order noise into ~2e-5 relative there, while the tensor as a whole agrees to
~1e-7. ``k_proj.bias`` of an attention layer has an exact gradient of zero (softmax is invariant
to a per-query shift of the scores): Adam normalises pure rounding noise there, so any two correct
implementations disagree in it, and :func:`max_rel_err` leaves it out by default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

__all__ = ["TOL", "rel_err", "assert_close", "max_rel_err", "lm_loss", "random_batches", "train_reference"]

TOL = 1e-5
"""fp32 parity tolerance on the per-tensor relative error (see ``[Note: per-tensor relative error]``)."""

Batch = tuple[torch.Tensor, torch.Tensor]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (``want`` is the reference)."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "tensor", tol: float = TOL) -> None:
    """``got`` has ``want``'s shape and lies within ``tol`` of it (per-tensor relative error)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    err = rel_err(got, want)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol} (shape {tuple(want.shape)})"


def max_rel_err(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], skip: tuple[str, ...] = ("k_proj.bias",)
) -> float:
    """The worst per-tensor relative error of state dict ``got`` against ``want`` (entries whose
    name ends with one of ``skip`` left out); an entry missing from ``got`` is a ``KeyError``."""
    return max((rel_err(got[k], v) for k, v in want.items() if not k.endswith(skip)), default=0.0)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32: logits (B, T, V), targets (B, T) -> scalar."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def random_batches(steps: int, batch: int = 4, seq: int = 16, vocab: int = 256, seed: int = 0) -> list[Batch]:
    """``steps`` batches of uniform random token ids ``(x, y)``, each (batch, seq), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
        for _ in range(steps)
    ]


def train_reference(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    clip: float | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The plain single-process PyTorch run engines are compared with: per batch forward, loss,
    backward, optional ``clip_grad_norm_``, ``step``, ``zero_grad``. ``autocast_dtype`` runs the
    forward under CPU autocast. Returns (a copy of the final state dict, the losses)."""
    losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
