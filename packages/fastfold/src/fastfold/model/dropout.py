"""Row-/column-shared dropout masks that are the same under DAP as on one rank.

[Note: dropout under DAP]
AlphaFold's row-wise dropout draws one mask [*, 1, R, c] shared by all rows and column-wise
dropout one mask [*, R, 1, c] shared by all columns. Every DAP layout splits exactly the axis the
mask is shared along (row-wise updates run with rows local, column-wise ones with columns local,
MSA row attention with sequences local), so each rank applies the *whole* mask to its slice and
the ranks must draw the same one. They do: the trunk draws one seed per forward from the global
RNG of DAP rank 0 (broadcast to the group; on one rank: from its own global RNG), each block gets
``seed + block_index`` and draws its masks in program order from a generator created from that
seed when the block runs, over the unpadded residue count (padding gets zeros). So DAP training
with dropout applies the same masks as the single-rank run with the same global seed, and a
checkpointed block that is recomputed draws the same masks again.
"""

from __future__ import annotations

import torch

from colossal import comm as C
from fastfold.parallel.dap import pad_axis

__all__ = ["SharedDropout", "draw_dropout_seed"]


class SharedDropout:
    """The dropout seed of one block and the unpadded residue count (see [Note: dropout under DAP])."""

    def __init__(self, seed: int, n_res: int):
        self.seed, self.n_res = seed, n_res

    def start(self, device: torch.device):
        """A fresh mask drawer for one run of the block: ``draw(like, p, shared_dim)`` returns the
        scaled keep mask (1 along ``shared_dim``, -3 or -2) for an update shaped like ``like``."""
        gen = torch.Generator(device=device).manual_seed(self.seed)

        def draw(like: torch.Tensor, p: float, shared_dim: int) -> torch.Tensor:
            other = -2 if shared_dim == -3 else -3  # the residue axis the mask varies along
            shape = list(like.shape)
            shape[shared_dim], shape[other] = 1, min(self.n_res, like.shape[other])
            keep = torch.bernoulli(like.new_full(shape, 1.0 - p), generator=gen) / (1.0 - p)
            return pad_axis(keep, other, like.shape[other])

        return draw


def draw_dropout_seed(n_blocks: int, n_res: int, device: torch.device, dap=None) -> list[SharedDropout]:
    """One :class:`SharedDropout` per block from one seed drawn from the global CPU RNG (of DAP
    rank 0, broadcast to the group on ``device``)."""
    seed = torch.randint(0, 2**62, (1,))
    if dap is not None:
        seed = seed.to(device)
        C.broadcast(seed, src=0, group=dap.group, tag="fastfold.dap.dropout_seed")
    return [SharedDropout(int(seed) + i, n_res) for i in range(n_blocks)]
