"""The memory recorder: allocated memory over the step, split into model and non-model data.

Samples come from two places:

* the profiler's own sampler, called at phase and module boundaries: on CUDA
  ``torch.cuda.memory_allocated``, on CPU the process resident set size (RSS, from
  ``/proc/self/statm``, else ``psutil`` when installed). Model data is the bytes of the
  model's parameters and gradients plus the optimizer's state tensors; non-model data is the
  rest (activations, buffers, and on CPU the interpreter itself);
* Gemini/ZeRO observers (``kind == "memory_sample"`` per tier, ``kind == "chunk_move"`` events).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from colossal.profiler.records import ChunkMove, MemoryPoint, StepRecord

__all__ = ["MemoryRecorder", "device_allocated", "model_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_STATM: list[int] = []  # an fd of /proc/self/statm, opened once: pread is ~1 µs, open+read ~20 µs


def _rss() -> int:
    try:
        if not _STATM:
            _STATM.append(os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_STATM[0], 128, 0).split()[1]) * _PAGE
    except OSError:
        try:
            import psutil
        except ImportError:
            return 0
        return psutil.Process().memory_info().rss


def device_allocated(device: torch.device) -> int:
    """Bytes allocated on ``device`` (CUDA: the caching allocator's count; CPU: process RSS)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _rss()


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def model_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters, their gradients and (if given) the optimizer's state tensors."""
    total = 0
    for p in params:
        total += _tensor_bytes(p) + _tensor_bytes(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(_tensor_bytes(v) for v in state.values())
    return total


class _ModelBytes:
    """:func:`model_bytes`, fast enough to call at every phase boundary.

    Parameter sizes are taken once; a gradient is counted with its parameter's size when present
    (autograd gradients have the parameter's shape); optimizer states are recounted only when the
    number of parameters with state changes (standard optimizers allocate state once).
    """

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        self._params, self._optimizer = params, optimizer
        self._sizes = [_tensor_bytes(p) for p in params]
        self._param_bytes = sum(self._sizes)
        self._states, self._state_bytes = -1, 0

    def __call__(self) -> int:
        grads = sum(size for p, size in zip(self._params, self._sizes) if p.grad is not None)
        if self._optimizer is not None and len(self._optimizer.state) != self._states:
            self._states = len(self._optimizer.state)
            self._state_bytes = model_bytes((), self._optimizer)
        return self._param_bytes + grads + self._state_bytes


class MemoryRecorder:
    """Samples memory into the current step; also receives Gemini/ZeRO memory events."""

    def __init__(
        self,
        step: Callable[[], StepRecord | None],
        clock: Callable[[], float],
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self._step, self._clock = step, clock
        self._params = list(model.parameters()) if model is not None else []
        first = self._params[0].device if self._params else torch.device("cpu")
        self.device = first if first.type != "meta" else torch.device("cpu")
        """Device sampled by the profiler's own sampler (that of the model's first parameter)."""
        self._count = _ModelBytes(self._params, optimizer)
        self._model_bytes = 0

    def sample(self, label: str, *, recount: bool = True) -> None:
        """Take one sample; ``recount=False`` reuses the last model-data count (cheap module boundaries)."""
        rec = self._step()
        if rec is None:
            return
        if recount:
            self._model_bytes = self._count()
        total = device_allocated(self.device)
        tier = str(self.device)
        point = MemoryPoint(self._clock(), tier, self._model_bytes, max(total - self._model_bytes, 0), label)
        rec.memory.append(point)

    def observe(self, event: Any, source: str) -> None:
        """Take a Gemini/ZeRO event (duck-typed on ``kind``) into the current step."""
        rec = self._step()
        kind = getattr(event, "kind", None)
        if rec is None:
            return
        if kind == "memory_sample":
            point = MemoryPoint(event.time, event.tier, event.model_bytes, event.non_model_bytes, event.label, source)
            rec.memory.append(point)
        elif kind == "chunk_move":
            move = ChunkMove(event.chunk_id, event.nbytes, event.src, event.dst, event.start, event.end, event.reason)
            rec.moves.append(move)
