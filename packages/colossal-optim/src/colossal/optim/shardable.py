"""Which ``torch.optim`` rules a sharding engine (ZeRO, Gemini) can step exactly.

[Note: optimizers a sharded engine can run]
ZeRO and Gemini hand the wrapped optimizer 1-D slices of flat buffers, not the parameters. An
element-wise rule (SGD, Adam/AdamW, Adagrad, RMSprop, ...: each element's update reads only that
element's gradient and state) gives the same update on a slice as on the whole tensor, and a
layer-wise rule with ``colossal.optim``'s ``norm_reducer`` contract (LAMB, LARS) gets its
whole-parameter norms from the reducer. A rule that needs a parameter's shape (Adafactor's row and
column factors, Muon's orthogonalised matrix update), a closure over the whole model (LBFGS) or
sparse gradients (SparseAdam) would run on the slices and silently compute something else
(Adafactor drifts 6e-2 from torch after 5 steps), so the engines refuse them at setup.
"""

from __future__ import annotations

import torch

__all__ = ["ELEMENTWISE", "check_shardable"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
"""``torch.optim`` rules that are element-wise (exact on slices)."""

_REFUSED = {
    "Adafactor": "factors its second moment over a parameter's rows and columns",
    "Muon": "orthogonalises each parameter's 2-D update",
    "LBFGS": "steps with a closure over the whole model",
    "SparseAdam": "needs sparse gradients",
}


def check_shardable(optimizer: torch.optim.Optimizer, engine: str) -> None:
    """``TypeError`` when ``optimizer`` is a rule ``engine`` cannot step on flat slices (see
    ``[Note: optimizers a sharded engine can run]``), naming what is supported."""
    for name, why in _REFUSED.items():
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(optimizer, cls):
            raise TypeError(
                f"{engine} cannot run torch.optim.{name}: it {why}, and {engine} gives the optimizer 1-D slices of "
                f"flat buffers. Supported: element-wise rules ({', '.join(ELEMENTWISE)}, colossal.optim's "
                "CPUAdam/HybridAdam) and colossal.optim.Lamb/Lars"
            )
