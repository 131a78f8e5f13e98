"""One training step of the Evoformer trunk: activation checkpointing per block, DAP gradient
reduction, optimizer step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastfold.parallel import Dap, reduce_gradients

__all__ = ["train_step", "run_training"]


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


def _rank_train(spec, steps: int):
    import os
    import time

    from fastfold.inference import TrunkResult, _load
    from fastfold.memory import current_rss_bytes, peak_device_bytes, peak_rss_bytes, reset_peak_memory

    torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // spec.dap_size))
    from colossal.comm import default_device

    model, feats = _load(spec, default_device())
    dap = Dap(overlap=not spec.no_overlap) if spec.dap_size > 1 else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    loss_fn = lambda m, z, s: m.pow(2).mean() + z.pow(2).mean() + s.pow(2).mean()
    train_step(model, feats, opt, loss_fn, dap=dap)  # warm-up
    reset_peak_memory(model)
    base, start, cpu_start = current_rss_bytes(), time.perf_counter(), time.process_time()
    for _ in range(steps):
        train_step(model, feats, opt, loss_fn, dap=dap)
    seconds, peak = (time.perf_counter() - start) / steps, peak_rss_bytes()
    cpu = (time.process_time() - cpu_start) / steps
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return TrunkResult(
        rank=rank,
        seconds=seconds,
        peak_rss_bytes=peak,
        activation_bytes=max(peak - base, 0),
        peak_device_bytes=peak_device_bytes(model),
        cpu_seconds=cpu,
    )


def run_training(spec, steps: int = 2, timeout: float = 3600.0) -> list:
    """Time ``steps`` checkpointed training steps (after one warm-up) of the random model of
    ``spec`` (a :class:`fastfold.inference.TrunkSpec`) on ``spec.dap_size`` processes; one
    :class:`fastfold.inference.TrunkResult` per rank (``seconds`` per step)."""
    from fastfold.inference import spawn_ranks

    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    return spawn_ranks(_rank_train, spec, steps, timeout=timeout)
