"""Dropout RNG for parallel layers: one shared stream where a tensor is replicated, one stream per
rank where it is split.

[Note: why two streams]
Where every rank of a tensor-parallel group holds the *same* activation (1D between blocks), the
dropout masks must be equal, or the replicas silently diverge. Where each rank holds a *different
slice* (attention heads in 1D, every block of 2D/2.5D/3D), the masks must differ, or the slices
share a pattern the dense model never would. :class:`RNGTracker` keeps one saved RNG state per
:class:`DropoutMode` and swaps it in for the duration of a ``with tracker.fork(mode):`` block
(Megatron's ``CudaRNGStatesTracker``, device-generic).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DropoutMode", "RNGTracker", "ParallelDropout"]

_SPLIT_OFFSET = 2718
"""Distance between the replicated seed and the first per-rank seed."""


class DropoutMode(enum.StrEnum):
    """Which RNG stream a dropout draws from."""

    REPLICATED = "replicated"
    """The tensor is identical on every rank of the group: same seed everywhere, same mask."""
    SPLIT = "split"
    """Each rank holds a different slice: seed offset by the rank, different masks."""


class RNGTracker:
    """Saved RNG states, one per :class:`DropoutMode`, for one tensor-parallel group."""

    def __init__(self, seed: int, split_rank: int, device: torch.device | str = "cpu"):
        if not isinstance(seed, int) or not isinstance(split_rank, int) or split_rank < 0:
            raise ValueError(f"seed must be an int and split_rank a non-negative int, got {seed!r}, {split_rank!r}")
        self.device = torch.device(device)
        """Device whose default generator is forked."""
        self.seeds = {DropoutMode.REPLICATED: seed, DropoutMode.SPLIT: seed + _SPLIT_OFFSET + split_rank}
        """Seed of each stream."""
        self._states = {mode: self._initial_state(s) for mode, s in self.seeds.items()}

    @classmethod
    def from_group(cls, seed: int, group: dist.ProcessGroup | None, device: torch.device | str = "cpu") -> RNGTracker:
        """A tracker whose split stream is offset by this rank's rank in ``group``."""
        return cls(seed, dist.get_rank(group), device)

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _initial_state(self, seed: int) -> torch.Tensor:
        saved = self._get()
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        state = self._get()
        self._set(saved)
        return state

    @contextlib.contextmanager
    def fork(self, mode: DropoutMode | str = DropoutMode.SPLIT) -> Iterator[None]:
        """Run the block on ``mode``'s stream; the default stream is restored afterwards."""
        mode = DropoutMode(mode)
        saved = self._get()
        self._set(self._states[mode])
        try:
            yield
        finally:
            self._states[mode] = self._get()
            self._set(saved)


class ParallelDropout(nn.Dropout):
    """``nn.Dropout`` drawing its mask from one stream of an :class:`RNGTracker`."""

    def __init__(self, p: float, tracker: RNGTracker, mode: DropoutMode | str = DropoutMode.SPLIT):
        super().__init__(p)
        self.tracker = tracker
        """Where the RNG states live."""
        self.mode = DropoutMode(mode)
        """Replicated (same mask on every rank) or split (per-rank mask)."""

    @classmethod
    def from_dense(cls, dropout: nn.Dropout, tracker: RNGTracker, mode: DropoutMode | str) -> ParallelDropout:
        """Same ``p`` as ``dropout``, drawn from ``tracker``'s ``mode`` stream."""
        return cls(dropout.p, tracker, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout under ``tracker.fork(mode)``."""
        with self.tracker.fork(self.mode):
            return super().forward(x)
