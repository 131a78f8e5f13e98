"""The mixture-of-experts layer: router, local experts, and expert-parallel dispatch/combine."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from colossal.moe.config import MoEConfig
from colossal.moe.dispatch import run_experts_parallel, sort_by_expert
from colossal.moe.experts import build_experts
from colossal.moe.router import Routing, TopKRouter

__all__ = ["MoE", "MoEStats", "attach_aux_loss", "moe_layers", "moe_aux_loss"]


@dataclasses.dataclass(frozen=True, slots=True)
class MoEStats:
    """What the last forward of one :class:`MoE` did with this rank's tokens."""

    tokens: int
    """Tokens routed (N)."""
    assignments: int
    """Token-expert assignments before capacity (N * k)."""
    dropped: int
    """Assignments dropped for lack of capacity (0 when dropless)."""
    tokens_dropped: int
    """Tokens all of whose assignments were dropped: their layer output is zero, so inside a
    residual block they pass through unchanged."""
    expert_counts: torch.Tensor
    """(E,) kept assignments per global expert (this rank's tokens only)."""
    load_balancing_loss: float
    """Unweighted Switch load-balancing loss (1.0 is perfect balance)."""
    z_loss: float
    """Unweighted router z-loss."""

    @property
    def load_imbalance(self) -> float:
        """Busiest expert's kept assignments over the mean (1.0 is perfect balance)."""
        mean = self.expert_counts.float().mean().item()
        return self.expert_counts.max().item() / mean if mean else 0.0


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: ``(..., C) -> (..., C)``.

    With ``ep_group`` of size ``ep``, this rank holds experts ``rank * E/ep .. (rank + 1) * E/ep - 1``
    and exchanges tokens with its peers (see ``[Note: expert-parallel dispatch]``); the router is
    replicated. Each rank routes its own tokens, and capacity is per rank (GShard's groups).

    After each forward, :attr:`aux_loss` holds ``aux_loss_coef * load_balancing + z_loss_coef *
    z_loss`` (a differentiable scalar to add to the training loss; see :func:`moe_aux_loss`) and
    :attr:`stats` a :class:`MoEStats`.
    """

    def __init__(
        self, config: MoEConfig, ep_group: ProcessGroup | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if config.num_experts % ep:
            raise ValueError(f"num_experts={config.num_experts} is not divisible by the expert-parallel size ep={ep}")
        self.config = config
        self.ep_group = ep_group if ep > 1 else None
        self.ep_size = ep
        self.ep_rank = dist.get_rank(ep_group) if ep > 1 else 0
        self.num_local_experts = config.num_experts // ep
        self.router = TopKRouter(config, device=device)
        self.experts = build_experts(config, self.num_local_experts, device=device)
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None

    def __getstate__(self) -> dict:
        """The state that ``copy.deepcopy`` and pickling see, with :attr:`aux_loss` detached: the last
        forward's graph stays with the original (torch refuses to deep-copy a tensor inside a graph,
        which broke an EMA copy of a model after any training step)."""
        state = self.__dict__.copy()
        if state.get("aux_loss") is not None:
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    @property
    def local_experts(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., C); dropped tokens get zero output."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, C)
        with record_function("colossal.moe::route"):
            routing = self.router(x2)
            k = self.config.top_k
            token = torch.arange(x2.shape[0], device=x.device).repeat_interleave(k)  # (N*k,) token per assignment
            kept = routing.keep.reshape(-1).nonzero().squeeze(1)  # (M,) kept assignments
            order, counts = sort_by_expert(routing.expert.reshape(-1)[kept], self.config.num_experts)
            kept = kept[order]  # sorted by global expert
            rows = token[kept]  # (M,) source token of each sorted row
            # index_select rather than x2[rows]: its backward is an index_add, not an accumulating index_put
            xs = x2.index_select(0, rows)  # (M, C)
        ys = self._run_experts(xs, counts)  # (M, C)
        with record_function("colossal.moe::combine_tokens"):
            w = routing.weight.reshape(-1).index_select(0, kept).to(ys.dtype)  # (M,)
            out = torch.zeros_like(x2).index_add_(0, rows, ys * w[:, None])  # (N, C)
        self._record(routing, x2.shape[0], counts)
        return out.view(shape)

    def _run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert with ``counts`` (E,) -> expert outputs, same order."""
        if self.ep_group is None:
            with record_function("colossal.moe::experts"):
                return self.experts(xs, counts)
        return run_experts_parallel(xs, counts, self.experts, self.ep_group)

    def _record(self, routing: Routing, tokens: int, counts: torch.Tensor) -> None:
        cfg = self.config
        lb, z = routing.load_balancing_loss, routing.z_loss
        self.aux_loss = cfg.aux_loss_coef * lb + cfg.z_loss_coef * z
        self.stats = MoEStats(
            tokens=tokens,
            assignments=routing.expert.numel(),
            dropped=routing.dropped,
            tokens_dropped=routing.tokens_dropped,
            expert_counts=counts.detach(),
            load_balancing_loss=float(lb.detach()),
            z_loss=float(z.detach()),
        )

    @torch.no_grad()
    def load_dense_experts(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice of full-size expert tensors (``name -> (E, ...)``, names as in
        ``self.experts``) into the local experts."""
        sl = slice(self.local_experts.start, self.local_experts.stop)
        for name, p in self.experts.named_parameters():
            full = state[name]
            if full.shape[0] != self.config.num_experts or full.shape[1:] != p.shape[1:]:
                raise ValueError(
                    f"expert tensor {name!r}: expected shape {(self.config.num_experts, *p.shape[1:])}, "
                    f"got {tuple(full.shape)}"
                )
            p.copy_(full[sl])

    @classmethod
    def from_dense(cls, dense: MoE, ep_group: ProcessGroup | None) -> MoE:
        """A copy of ``dense`` (holding all experts) that keeps only this rank's experts of ``ep_group``."""
        moe = cls(dense.config, ep_group, device=dense.router.gate.weight.device)
        with torch.no_grad():
            moe.router.gate.weight.copy_(dense.router.gate.weight)
        moe.load_dense_experts(dict(dense.experts.named_parameters()))
        return moe


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` inside ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the weighted auxiliary losses of every MoE layer's last forward (``None`` if none
    ran). Add it to the task loss: ``loss = ce + moe_aux_loss(model)``."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``x``; its backward also seeds ``aux`` with the gradient ``weight``."""

    @staticmethod
    def forward(ctx, x, aux, weight, sink):
        ctx.weight, ctx.sink, ctx.value = weight, sink, aux.detach()
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.sink is not None:
            ctx.sink.append(ctx.value)
        return grad, torch.full_like(ctx.value, ctx.weight), None, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, weight: float = 1.0, sink: list | None = None) -> torch.Tensor:
    """``x`` unchanged, but whatever backpropagates through it also backpropagates ``weight * aux``:
    the gradient is that of a loss ``L + weight * aux`` although ``aux`` never reaches ``L``.

    This is how an auxiliary loss of a layer on one pipeline stage enters training when the loss
    is computed on another stage: attach it to the layer's output, and the stage's backward of
    that micro-batch carries it (``weight``: the micro-batch's share of the step loss, times a
    loss scale if any). Each backward appends the detached ``aux`` to ``sink`` (when given), so the
    caller can report the aux losses that were actually trained on.
    """
    return _AuxLossGrad.apply(x, aux, float(weight), sink)
