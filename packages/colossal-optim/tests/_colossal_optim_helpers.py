"""Shared helpers of the colossal-optim tests: random problems and uneven shards."""

import torch

SHAPES = [(6, 5), (7,), (3, 2, 4), (4, 4)]


def make_params(seed: int, dtype=torch.float64, zero_index: int | None = 2) -> list[torch.Tensor]:
    """Random tensors; the one at ``zero_index`` is all zeros (a zero-norm weight)."""
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]
    if zero_index is not None:
        ps[zero_index].zero_()
    return ps


def make_grads(seed: int, step: int, dtype=torch.float64, zero_index: int | None = 3) -> list[torch.Tensor]:
    """Random gradients for ``step``; the one at ``zero_index`` is all zeros (a zero-norm gradient)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    gs = [torch.randn(s, generator=gen, dtype=dtype) * (0.1 + i) for i, s in enumerate(SHAPES)]
    if zero_index is not None:
        gs[zero_index].zero_()
    return gs


def shard_bounds(numel: int, world: int, gen: torch.Generator) -> list[int]:
    """Random uneven contiguous cut points of ``numel`` elements into ``world`` pieces (some may be empty)."""
    cuts = sorted(torch.randint(0, numel + 1, (world - 1,), generator=gen).tolist())
    return [0, *cuts, numel]


def my_shard(t: torch.Tensor, rank: int, bounds: list[int]) -> torch.Tensor:
    return t.reshape(-1)[bounds[rank] : bounds[rank + 1]].clone()
