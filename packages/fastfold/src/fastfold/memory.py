"""Peak memory of the current process: host RSS high-water mark (resettable on Linux; read by
:mod:`colossal.comm.memory`) and the CUDA allocator's peak on the device a model lives on.

[Note: no reset of a caller's CUDA peak]
``torch.cuda.reset_peak_memory_stats`` cannot be undone (torch has no way to set a peak back), so a
library call that resets it destroys the high-water mark its caller is measuring. Only
:func:`reset_peak_memory`, called explicitly, resets it; :func:`device_peak_during` measures a call
without resetting: the allocator's peak after the call is the call's own peak exactly when the call
raised it above the peak before the call; otherwise the call's peak is only known to be at most the
earlier peak, and ``None`` says so rather than reporting a number that is not the call's."""

from __future__ import annotations

import torch

from colossal.comm.memory import reset_peak_rss, rss_and_peak_bytes  # the one reader of host RSS

__all__ = [
    "reset_peak_memory",
    "reset_peak_rss",
    "peak_rss_bytes",
    "current_rss_bytes",
    "peak_device_bytes",
    "device_of",
    "device_peak_during",
]


def device_of(where: torch.nn.Module | torch.Tensor | torch.device | str | None = None) -> torch.device:
    """The device of ``where``: a module's first parameter (else first buffer; CPU for a module
    without tensors), a tensor's device, a device itself; ``None`` is the current CUDA device when
    CUDA is available, else the CPU."""
    if where is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(where, torch.nn.Module):
        t = next(iter(where.parameters()), None)
        if t is None:
            t = next(iter(where.buffers()), None)
        return t.device if t is not None else torch.device("cpu")
    if isinstance(where, torch.Tensor):
        return where.device
    if isinstance(where, (torch.device, str)):
        return torch.device(where)
    raise TypeError(f"expected a module, tensor, device or None, got {type(where).__name__}")


def _cuda_index(where) -> int | None:
    """The CUDA device index of ``where`` (see :func:`device_of`), ``None`` off CUDA."""
    device = device_of(where)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_peak_memory(where=None) -> bool:
    """Reset the RSS high-water mark (:func:`reset_peak_rss`) and the CUDA peak of the device of
    ``where`` (a module, tensor or device; see :func:`device_of`); ``False`` when the host mark
    cannot be reset. Destroys any peak a caller is measuring on that device: library code measures
    with :func:`device_peak_during` instead."""
    index = _cuda_index(where)
    if index is not None:
        torch.cuda.reset_peak_memory_stats(index)
    return reset_peak_rss()


def peak_rss_bytes() -> int:
    """Host RSS high-water mark in bytes (since the last successful :func:`reset_peak_memory`)."""
    return rss_and_peak_bytes()[1] or 0


def current_rss_bytes() -> int:
    """Current host RSS in bytes (0 where ``/proc`` is unavailable)."""
    return rss_and_peak_bytes()[0] or 0


def peak_device_bytes(where=None) -> int:
    """CUDA allocator peak in bytes on the device of ``where`` (a model: the device of its
    parameters; a tensor or device; see :func:`device_of`), since the process started or the last
    reset of that device's peak; 0 off CUDA."""
    index = _cuda_index(where)
    return torch.cuda.max_memory_allocated(index) if index is not None else 0


class device_peak_during:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Measure the CUDA allocator peak of a block on the device of ``where`` without resetting
    anyone's peak (see [Note: no reset of a caller's CUDA peak]).

    After the block, :attr:`peak_bytes` is the peak reached during the block when it raised the
    device's high-water mark, else ``None`` (the block's peak is then at most :attr:`prior_peak_bytes`,
    the mark before it, and cannot be told apart without a reset); 0 off CUDA.
    """

    def __init__(self, where=None) -> None:
        self.index = _cuda_index(where)
        self.prior_peak_bytes = 0
        self.peak_bytes: int | None = 0

    def __enter__(self) -> device_peak_during:
        if self.index is not None:
            self.prior_peak_bytes = torch.cuda.max_memory_allocated(self.index)
        return self

    def __exit__(self, *exc) -> None:
        if self.index is not None:
            after = torch.cuda.max_memory_allocated(self.index)
            self.peak_bytes = after if after > self.prior_peak_bytes else None
