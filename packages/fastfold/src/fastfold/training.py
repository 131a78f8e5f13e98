"""One training step of the Evoformer trunk: activation checkpointing per block, DAP gradient
reduction, optimizer step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastfold.parallel import Dap, reduce_gradients

__all__ = ["train_step"]


def train_step(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    dap: Dap | None = None,
    checkpoint: bool = True,
) -> float:
    """Forward ``model(**inputs)`` (each block recomputed in backward when ``checkpoint``), then
    ``loss_fn(*outputs)``, backward, the DAP gradient sum, and ``optimizer.step()``. Every rank of
    the DAP group passes the same whole ``inputs``; returns the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with torch.profiler.record_function("fastfold::forward"):
        outputs = model(**inputs, dap=dap, checkpoint=checkpoint)
        loss = loss_fn(*(outputs if isinstance(outputs, tuple) else (outputs,)))
    with torch.profiler.record_function("fastfold::backward"):
        loss.backward()
    if dap is not None:
        reduce_gradients(model, dap)
    with torch.profiler.record_function("fastfold::optimizer_step"):
        optimizer.step()
    return float(loss.detach())
