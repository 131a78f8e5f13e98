"""Fixed-length training windows over a token stream, and a resumable distributed sampler."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["TokenWindows", "ResumableDistributedSampler"]


class TokenWindows(Dataset):
    """Non-overlapping windows of a 1-D token stream: item i = (x, y), each (T,), y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len <= 0 or tokens.numel() < seq_len + 1:
            raise ValueError(f"seq_len must lie in [1, {tokens.numel() - 1}], got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()  # (T+1,)
        return window[:-1], window[1:]


class ResumableDistributedSampler(DistributedSampler):
    """A :class:`DistributedSampler` that can start mid-epoch.

    [Note: data position across world sizes]
    With shuffling, rank r of W takes ``perm[r::W]`` of the epoch's permutation, so global step s
    (per-rank batch b) consumes exactly ``perm[s*b*W : (s+1)*b*W]``: the global batch does not
    depend on how it is split over ranks. The position is therefore saved as *global samples
    consumed in this epoch*; on resume each rank skips ``consumed // W`` of its own samples, which
    continues the same sample sequence under a different world size (same global batch size).
    """

    def __init__(self, dataset, *args, **kwargs) -> None:
        kwargs.setdefault("drop_last", True)
        super().__init__(dataset, *args, **kwargs)
        self.start_index = 0

    def set_position(self, epoch: int, consumed_samples: int) -> None:
        """Resume at ``epoch`` after ``consumed_samples`` global samples of that epoch."""
        if consumed_samples % self.num_replicas:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be a multiple of the world size {self.num_replicas}"
            )
        self.set_epoch(epoch)
        self.start_index = consumed_samples // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start a new epoch from its beginning."""
        super().set_epoch(epoch)
        self.start_index = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples - self.start_index
