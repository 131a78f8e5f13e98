"""The communication recorder: every collective with caller and bandwidths; straggler waits."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from colossal.profiler.records import CommRecord

__all__ = ["CommRecorder", "caller_of", "straggler_waits"]

_SKIP = ("colossal.", "torch.", "torch")


def caller_of(frame: Any = None) -> str:
    """``file:line (function)`` of the first frame outside colossal.* and torch.* (cheap frame walk).

    torch frames are skipped too, so a collective issued from an autograd backward is attributed
    to the user's ``loss.backward()`` line rather than to torch's engine entry point.
    """
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_SKIP):
            code = frame.f_code
            return f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return "<unknown>"


class CommRecorder:
    """Observer of comm events; appends a :class:`CommRecord` to ``sink()``.

    ``sink`` returns the list to append to (the current step's), or None to drop the event.
    """

    def __init__(self, sink: Callable[[], list | None]) -> None:
        self._sink = sink

    def __call__(self, event: Any) -> None:
        out = self._sink()
        if out is None:
            return
        out.append(
            CommRecord(
                op=event.op,
                group_size=event.group_size,
                ranks=tuple(event.ranks),
                nbytes=int(event.nbytes),
                wire_bytes=float(event.wire_bytes),
                dtype=str(event.dtype).removeprefix("torch."),
                async_op=bool(event.async_op),
                start=event.start,
                end=event.end,
                tag=event.tag,
                caller=caller_of(sys._getframe(1)),
            )
        )


def straggler_waits(records: list[CommRecord], gathered: list[list[tuple[tuple[int, ...], float]]]) -> None:
    """Fill ``record.wait``: this rank's duration minus the fastest member's, per collective.

    ``gathered[r]`` lists rank r's ``(ranks, duration)`` in completion order. The k-th collective
    on a group is matched with the k-th collective on that same group on every member, so
    collectives on different groups may interleave differently per rank.
    """
    per_rank = [_by_group(seq) for seq in gathered]
    seen: dict[tuple[int, ...], int] = {}
    for rec in records:
        key = tuple(sorted(rec.ranks))  # p2p: (self, peer) on one side is (peer, self) on the other
        k = seen.get(key, 0)
        seen[key] = k + 1
        peers = [per_rank[r][key][k] for r in key if r < len(per_rank) and _has(per_rank[r], key, k)]
        rec.wait = rec.duration - min(peers, default=rec.duration)


def _by_group(seq: list[tuple[tuple[int, ...], float]]) -> dict[tuple[int, ...], list[float]]:
    out: dict[tuple[int, ...], list[float]] = {}
    for ranks, duration in seq:
        out.setdefault(tuple(sorted(ranks)), []).append(duration)
    return out


def _has(groups: dict[tuple[int, ...], list[float]], ranks: tuple[int, ...], k: int) -> bool:
    return len(groups.get(ranks, ())) > k
