"""Expert parallelism for Hugging Face Mixtral: each ``MixtralSparseMoeBlock`` becomes a
:class:`MixtralExpertParallelBlock` that holds this rank's experts and exchanges tokens with
``colossal.moe.run_experts_parallel``.

[Note: Mixtral's routing, kept exactly]
``transformers`` 5.x stores a block's experts stacked (``MixtralExperts``: ``gate_up_proj``
``(E, 2F, C)``, ``down_proj`` ``(E, C, F)``; ``x -> down(act(gate) * up)`` with
``gate, up = (x @ gate_up_proj[e].T).chunk(2)``) behind a ``MixtralTopKRouter`` ``gate``
(``(E, C)`` weight; softmax in fp32 over the logits, top-k, the chosen probabilities divided by
their sum). The replacement keeps the router *module* itself: the same weights, the same code, and
the ``router_logits`` output recorder of ``transformers`` still hooks it, so the model's own
load-balancing aux loss (``output_router_logits=True``) is computed as before, over this rank's
tokens, as data parallelism without experts split would. Jitter noise (training, when the config
sets it) multiplies the block input as ``transformers`` does. Every assignment runs (no capacity,
no dropping); each row's output is multiplied by its fp32 routing weight and summed into its token,
as ``MixtralExperts.forward`` does. Only the experts move: rank ``r`` of the ``ep`` group holds
experts ``r * E/ep .. (r + 1) * E/ep - 1`` as slices of the same two tensors, under the same
names, so the model's state dict (gathered over ``ep`` by the hybrid plugin) is the Hugging Face
one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["MixtralExpertParallelBlock", "MixtralLocalExperts", "is_mixtral_moe_block"]


def is_mixtral_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` 5.x Mixtral sparse-MoE block (a router ``gate`` and
    stacked ``experts.gate_up_proj`` / ``experts.down_proj``), split or not."""
    experts = getattr(module, "experts", None)
    return (
        hasattr(module, "gate")
        and hasattr(module, "top_k")
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


class MixtralLocalExperts(nn.Module):
    """This rank's experts of a ``MixtralExperts``, in its layout and under its names:
    ``gate_up_proj`` (E_local, 2F, C), ``down_proj`` (E_local, C, F). ``forward`` takes what
    ``MixtralExperts.forward`` takes (every token of this rank) and exchanges rows over ``group``."""

    def __init__(self, experts: nn.Module, group: ProcessGroup) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]  # over all ranks (E)
        self.ep_group, self.ep_size, self.ep_rank = group, dist.get_world_size(group), dist.get_rank(group)
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}")
        self.num_local = self.num_experts // self.ep_size
        self.act_fn = experts.act_fn
        local = slice(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(experts, name)
            param = nn.Parameter(dense.detach()[local].clone(), requires_grad=dense.requires_grad)
            self.register_parameter(name, param)

    def run_local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (R, C) sorted by local expert, ``counts`` (E_local,) -> (R, C) expert outputs."""
        from colossal.moe import grouped_mm

        gate, up = grouped_mm(x, self.gate_up_proj.transpose(1, 2), counts).chunk(2, dim=-1)  # (R, F) each
        return grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), counts)  # (R, C)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``hidden_states`` (N, C), ``top_k_index`` / ``top_k_weights`` (N, k) -> (N, C):
        ``sum_j w[n, j] * expert[index[n, j]](x[n])``. Collective over the ep group."""
        from colossal.moe import run_experts_parallel, sort_by_expert

        n, k = top_k_index.shape
        order, counts = sort_by_expert(top_k_index.reshape(-1), self.num_experts)  # by global expert
        rows = torch.arange(n, device=hidden_states.device).repeat_interleave(k)[order]  # (N*k,) token of each row
        xs = hidden_states.index_select(0, rows)  # (N*k, C)
        ys = run_experts_parallel(xs, counts, self.run_local, self.ep_group)  # (N*k, C), same order
        weight = top_k_weights.reshape(-1).index_select(0, order)[:, None]  # (N*k, 1) fp32
        return torch.zeros_like(hidden_states).index_add_(0, rows, (ys * weight).to(hidden_states.dtype))


class MixtralExpertParallelBlock(nn.Module):
    """A ``MixtralSparseMoeBlock`` whose experts are split over an ``ep`` group
    (``[Note: Mixtral's routing, kept exactly]``): ``gate`` is the block's own router,
    ``experts`` a :class:`MixtralLocalExperts`. ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, block: nn.Module, group: ProcessGroup) -> None:
        super().__init__()
        self.top_k = block.top_k
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        self.gate = block.gate
        self.experts = MixtralLocalExperts(block.experts, group)

    @property
    def ep_size(self) -> int:
        """Ranks the experts are split over."""
        return self.experts.ep_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Route every token with the block's router, run its top-k experts wherever they live."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x = hidden_states.reshape(-1, shape[-1])  # (N, C)
        _, top_k_weights, top_k_index = self.gate(x)
        return self.experts(x, top_k_index, top_k_weights).reshape(shape)
