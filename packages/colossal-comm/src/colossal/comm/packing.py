"""Layout arithmetic the engines and the planner share: packing tensors into chunks in order, the
chunk size with the least padding, and the prefetch windows over a traced operator sequence.

Pure functions of sizes and sequences (no tensors, no process group), so that ``colossal.gemini``
applies them and ``colossal.planner`` predicts with the very same rules, without importing the
engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["pack", "search_chunk_size", "plan_depths", "upcoming_chunks"]


def pack(numels: Sequence[int], chunk_size: int) -> list[list[int]]:
    """Indices of ``numels`` per chunk, packed in order (a tensor that does not fit opens a new chunk)."""
    chunks: list[list[int]] = []
    left = 0
    for i, n in enumerate(numels):
        if n > chunk_size:
            raise ValueError(f"chunk_size={chunk_size} is smaller than a parameter of {n} elements")
        if n > left:
            chunks.append([])
            left = chunk_size
        chunks[-1].append(i)
        left -= n
    return chunks


def search_chunk_size(numels: Sequence[int], align: int = 1, search_range: int | None = None, steps: int = 64) -> int:
    """Chunk size (elements, a multiple of ``align``) that minimises padding when packing ``numels`` in order.

    Candidates run from the largest tensor to ``largest + search_range`` (default: twice the largest) in
    ``steps`` equal steps; ties go to the smaller size (more chunks = finer placement).
    """
    if not numels:
        raise ValueError("cannot size chunks for a model without parameters")
    lo = -(-max(numels) // align) * align
    span = lo if search_range is None else search_range
    stride = max(align, -(-span // steps) // align * align)
    best, best_waste = lo, None
    for size in range(lo, lo + span + 1, stride):
        waste = len(pack(numels, size)) * size - sum(numels)
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
    return best


def upcoming_chunks(ops: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """For each operator, the distinct chunks later operators use, in first-use order (own chunks excluded)."""
    out: list[list[int]] = [[] for _ in ops]
    later: list[int] = []  # distinct chunks of ops j+1.., in first-use order
    for j in range(len(ops) - 1, -1, -1):
        out[j] = [c for c in later if c not in ops[j]]
        nxt = list(dict.fromkeys(ops[j]))
        later = nxt + [c for c in later if c not in nxt]
    return out


def plan_depths(ops: Sequence[tuple[int, ...]], depth: int, fits: Callable[[int, list[int]], bool]) -> list[int]:
    """Per operator, how many upcoming chunks to keep gathered: the largest ``k <= depth`` such that
    ``fits(j, own chunks + first k upcoming chunks)``, then lowered where a chunk prefetched for a later
    operator would leave the next, shallower window before its use (it would be gathered twice)."""
    upcoming = upcoming_chunks(ops)
    ks = []
    for j, own in enumerate(ops):
        k = min(depth, len(upcoming[j]))
        while k > 0 and not fits(j, list(own) + upcoming[j][:k]):
            k -= 1
        ks.append(k)
    for j in range(len(ks) - 2, -1, -1):
        nxt = set(ops[j + 1]) | set(upcoming[j + 1][: ks[j + 1]])
        kept = 0
        while kept < ks[j] and upcoming[j][kept] in nxt:
            kept += 1
        ks[j] = kept
    return ks
