"""colossal.moe: mixture-of-experts layers with expert parallelism.

Routers (Switch top-1, GShard / Mixtral top-k, capacity and dropless), experts stored as stacked
weights and run as grouped matmuls, differentiable uneven all-to-all dispatch over an ``ep``
group, and the helpers that reduce expert and dense gradients over their own groups.
"""

from colossal.moe.config import EXPERT_KINDS, MoEConfig
from colossal.moe.dispatch import all_to_all_uneven, exchange_counts, run_experts_parallel, sort_by_expert
from colossal.moe.experts import MLPExperts, SwiGLUExperts, build_experts, grouped_mm
from colossal.moe.layer import MoE, MoEStats, attach_aux_loss, moe_aux_loss, moe_layers
from colossal.moe.parallel import ExpertGroups, dense_parameters, expert_groups, expert_parameters, reduce_gradients
from colossal.moe.router import Routing, TopKRouter, capacity, load_balancing_loss, router_z_loss

__all__ = [
    "EXPERT_KINDS",
    "ExpertGroups",
    "MLPExperts",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "Routing",
    "SwiGLUExperts",
    "TopKRouter",
    "all_to_all_uneven",
    "attach_aux_loss",
    "build_experts",
    "capacity",
    "dense_parameters",
    "exchange_counts",
    "expert_groups",
    "expert_parameters",
    "grouped_mm",
    "load_balancing_loss",
    "moe_aux_loss",
    "moe_layers",
    "reduce_gradients",
    "router_z_loss",
    "run_experts_parallel",
    "sort_by_expert",
]
