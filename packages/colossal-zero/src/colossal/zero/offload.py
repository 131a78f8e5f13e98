"""Where the fp32 master shards live, and moving gradients to them (static ZeRO-Offload).

Without offload the masters sit on the compute device; with fp32 working parameters they are
the rank's slice of the working parameters themselves (no copy). With ``offload=True`` the
masters, their gradients and the optimizer states live on the CPU (pinned when CUDA is present),
the optimizer steps there, and only the working parameters stay on the device.
"""

from __future__ import annotations

import time

import torch

from colossal.zero import _events
from colossal.zero._flat_param import FlatParam

__all__ = ["place_master", "master_grad"]


def place_master(flat: FlatParam, own: torch.Tensor, own32: torch.Tensor, offload: bool) -> None:
    """Set ``flat.master`` from this rank's slice: ``own`` (working dtype, device), ``own32`` (fp32)."""
    flat.master_aliased = own.dtype == torch.float32 and not offload
    if flat.master_aliased:
        flat.master = own
        return
    flat.master = own32.clone().to("cpu" if offload else own.device)
    if offload and torch.cuda.is_available():
        flat.master = flat.master.pin_memory()


def master_grad(flat: FlatParam, grad: torch.Tensor, chunk_id: int) -> torch.Tensor:
    """Attach ``grad`` (the reduced shard, working dtype) to the master as fp32 ``.grad``."""
    if flat.master_aliased:
        flat.master.grad = grad
        return grad
    start = time.perf_counter()
    flat.master.grad = grad.to(device=flat.master.device, dtype=torch.float32)
    if grad.device != flat.master.device and _events.has_observers():
        _events.emit(
            _events.ChunkMoveEvent(
                chunk_id=chunk_id,
                nbytes=grad.numel() * grad.element_size(),
                src=grad.device.type,
                dst=flat.master.device.type,
                start=start,
                end=time.perf_counter(),
                reason="offload_grad",
            )
        )
    return flat.master.grad
