"""Chunked application of a row-independent function, bounding the peak memory of its intermediates.

[Note: chunking and in-place accumulation]
Every Evoformer operator is independent along one "batch" axis: MSA row attention along sequences,
column attention along residues, triangle operations along rows of the pair representation,
transitions along everything. ``chunk_apply`` runs the function on ``chunk_size`` slices of that
axis so the large intermediates (attention logits ``[H, Q, K]``, transition hidden ``4c``) exist
for one chunk at a time. Results are written into one preallocated output (no list + ``cat``,
which would hold the output twice); with ``accumulate_into`` they are added straight into the
residual stream instead (the in-place inference variant), so no full-size update tensor exists at
all. The in-place form is only valid when a chunk's inputs do not overlap the rows other chunks
later read, which the callers guarantee (see each module) and is inference-only (no autograd).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["chunk_apply", "check_chunk_size"]


def check_chunk_size(chunk_size: int | None) -> None:
    """Raise ``ValueError`` unless ``chunk_size`` is ``None`` or a positive int."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")


def _slice(arg, dim: int | None, start: int, length: int):
    if arg is None or dim is None or arg.shape[dim] == 1:
        return arg  # broadcast along the chunked axis
    return arg.narrow(dim, start, length)


def chunk_apply(
    fn: Callable[..., torch.Tensor],
    args: Sequence[torch.Tensor | None],
    dims: Sequence[int | None],
    chunk_size: int | None,
    out_dim: int,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fn(*args)`` computed ``chunk_size`` slices at a time along each arg's axis ``dims[i]``
    (``None``: pass whole), the pieces placed along ``out_dim`` of the result, or added in place into
    ``accumulate_into`` (returned) when given."""
    check_chunk_size(chunk_size)
    if len(args) != len(dims):
        raise ValueError(f"got {len(args)} args but {len(dims)} dims")
    sizes = {a.shape[d] for a, d in zip(args, dims) if a is not None and d is not None and a.shape[d] != 1}
    if len(sizes) > 1:
        raise ValueError(f"args disagree on the size of the chunked axis: {sorted(sizes)}")
    size = sizes.pop() if sizes else 1
    if accumulate_into is None and (chunk_size is None or chunk_size >= size):
        return fn(*args)
    step = size if chunk_size is None else chunk_size
    out = accumulate_into
    for start in range(0, size, step):
        length = min(step, size - start)
        piece = fn(*[_slice(a, d, start, length) for a, d in zip(args, dims)])
        if out is None:
            shape = list(piece.shape)
            shape[out_dim] = size
            out = piece.new_empty(shape)
        if accumulate_into is not None:
            out.narrow(out_dim, start, length).add_(piece)
        else:
            out.narrow(out_dim, start, length).copy_(piece)
    return out
