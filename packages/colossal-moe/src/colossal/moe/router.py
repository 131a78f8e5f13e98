"""Top-k routers: Switch (top-1) and GShard / Mixtral (top-k), with capacity and auxiliary losses.

References: Fedus, Zoph, Shazeer, "Switch Transformers" (2021): top-1 routing, capacity factor,
jitter noise and the load-balancing loss; Lepikhin et al., "GShard" (2020): top-2 routing with
first choices served before second choices; Zoph et al., "ST-MoE" (2022): the router z-loss;
Gale et al., "MegaBlocks" (2022): dropless routing.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from colossal.moe.config import MoEConfig

__all__ = ["Routing", "TopKRouter", "capacity", "load_balancing_loss", "router_z_loss"]


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    """Where one batch of ``N`` tokens goes. Tensors are on the input's device."""

    expert: torch.Tensor
    """(N, k) int64: chosen experts per token, best first."""
    weight: torch.Tensor
    """(N, k) float32: combine weight of each choice (differentiable w.r.t. the router)."""
    keep: torch.Tensor
    """(N, k) bool: False where the choice was dropped for lack of capacity."""
    capacity: int | None
    """Tokens an expert takes from this batch (``None`` = dropless)."""
    load_balancing_loss: torch.Tensor
    """Scalar Switch loss ``E * sum_e f_e * P_e`` (1 at perfect balance), unweighted."""
    z_loss: torch.Tensor
    """Scalar ST-MoE z-loss ``mean_n logsumexp(logits_n) ** 2``, unweighted."""

    @property
    def dropped(self) -> int:
        """Number of (token, expert) assignments dropped."""
        return int((~self.keep).sum())

    @property
    def tokens_dropped(self) -> int:
        """Number of tokens all of whose choices were dropped (their output is zero)."""
        return int((~self.keep).all(dim=1).sum())

    def expert_counts(self, num_experts: int, kept: bool = True) -> torch.Tensor:
        """(E,) int64: assignments per expert (only the kept ones when ``kept``)."""
        chosen = self.expert[self.keep] if kept else self.expert.reshape(-1)
        return torch.bincount(chosen, minlength=num_experts)


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int = 0) -> int:
    """Tokens each expert accepts: ``max(min_capacity, ceil(capacity_factor * N * k / E))``."""
    return max(min_capacity, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Switch's auxiliary loss ``E * sum_e f_e * P_e``.

    ``probs`` (N, E) are the router probabilities, ``expert`` (N, k) the chosen experts; ``f_e``
    is the fraction of the ``N * k`` assignments that chose expert ``e`` (before capacity), ``P_e``
    the mean probability of ``e``. For ``k = 1`` this is exactly Switch's loss; for ``k > 1`` every
    choice counts (as in Mixtral), divided by ``k`` so that the uniform optimum is still 1.
    """
    n, e = probs.shape
    f = torch.bincount(expert.reshape(-1), minlength=e).to(probs.dtype) / expert.numel()  # (E,)
    return e * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss ``mean_n (logsumexp_e logits[n, e]) ** 2``: keeps router logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def _keep_within_capacity(expert: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """(N, k) bool: an assignment survives if fewer than ``cap`` earlier ones chose its expert.

    Order of priority (GShard): every token's first choice in token order, then every token's
    second choice, and so on.
    """
    n, k = expert.shape
    order = expert.t().reshape(-1)  # (k*N,) choice-major
    onehot = F.one_hot(order, num_experts)  # (k*N, E)
    position = (onehot.cumsum(dim=0) - 1).gather(1, order[:, None]).squeeze(1)  # (k*N,)
    return (position < cap).view(k, n).t()


def _narrows(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` is ``before`` cast from float32 (or wider) to a narrower floating dtype."""
    if not (before.is_floating_point() and after.is_floating_point()):
        return False
    return torch.finfo(before.dtype).bits >= 32 and torch.finfo(after.dtype).bits < 32


class TopKRouter(nn.Module):
    """A linear gate ``C -> E`` (no bias) with softmax, top-k choice and capacity.

    Computed in float32 whatever the input dtype (router precision matters: Switch, section 2.4),
    and the gate stays float32 when the model is cast to a lower precision (see
    ``[Note: the router stays float32]``).
    """

    def __init__(self, config: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden, config.num_experts, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` (N, C); returns a :class:`Routing`."""
        cfg = self.config
        if self.training and cfg.jitter > 0:
            noise = torch.empty_like(x).uniform_(1.0 - cfg.jitter, 1.0 + cfg.jitter)
            x = x * noise
        logits = F.linear(x.float(), self.gate.weight.float())  # (N, E)
        probs = torch.softmax(logits, dim=-1)  # (N, E)
        weight, expert = torch.topk(probs, cfg.top_k, dim=-1)  # (N, k), (N, k)
        if cfg.top_k > 1 and cfg.renormalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if cfg.dropless:
            cap, keep = None, torch.ones_like(expert, dtype=torch.bool)
        else:
            cap = capacity(x.shape[0], cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.min_capacity)
            keep = _keep_within_capacity(expert, cfg.num_experts, cap)
        return Routing(
            expert=expert,
            weight=weight,
            keep=keep,
            capacity=cap,
            load_balancing_loss=load_balancing_loss(probs, expert),
            z_loss=router_z_loss(logits),
        )

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` with the gate kept out of lower precisions.

        [Note: the router stays float32]
        Switch Transformers (section 2.4) keeps the router in float32 while the rest of the model
        runs in bfloat16: rounding the gate weights or logits changes which expert a token picks.
        ``model.to(torch.bfloat16)``, ``.half()`` and ``.bfloat16()`` all reach every module through
        ``_apply(fn)``; here ``fn`` is wrapped so that a tensor it would turn from float32 (or
        wider) into a narrower floating dtype is instead moved, unrounded, to the device ``fn``
        chose (device moves, ``to_empty`` and casts to a wider dtype apply as given). Parameters,
        their gradients and buffers are all covered; ``forward`` casts the input to float32.
        """

        def keep_wide(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return t.to(device=out.device) if _narrows(t, out) else out

        return super()._apply(keep_wide, recurse=recurse)
