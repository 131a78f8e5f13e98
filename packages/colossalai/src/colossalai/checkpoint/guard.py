"""Every rank must save and load: detect the ``if rank == 0: booster.save_model(...)`` mistake.

Each Booster checkpoint call runs :func:`check_all_ranks_arrive` first: the arrival check of
``colossal.comm`` ([Note: the arrival check] in :mod:`colossal.comm.arrival`) over the default
process group, raising a :class:`CheckpointError` that names the ranks that never arrived (or the
different operations they called). The engine-level save/load functions of ``colossal.zero`` and
``colossal.gemini`` run the same check over their own groups; inside a Booster call they skip it
(one check per user-facing call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from colossal.comm import DEFAULT_ARRIVAL_TIMEOUT, monitored_call
from colossal.comm.checkpoint import CheckpointError

__all__ = ["check_all_ranks_arrive", "arrival_checked", "DEFAULT_ARRIVAL_TIMEOUT"]

_HINT = (
    "Saving and loading are collective: call them on every rank (not under 'if rank == 0:'); a rank that is "
    "legitimately slower needs a larger Booster(checkpoint_timeout=...)"
)


@contextlib.contextmanager
def arrival_checked(op: str, timeout: float = DEFAULT_ARRIVAL_TIMEOUT) -> Iterator[None]:
    """Check that every rank of the default group entered ``op`` (within ``timeout`` seconds), then
    run the block; the engines' own checks inside it are skipped."""
    with monitored_call(op, None, timeout, error=CheckpointError, hint=_HINT):
        yield


def check_all_ranks_arrive(op: str, timeout: float = DEFAULT_ARRIVAL_TIMEOUT) -> None:
    """Raise :class:`CheckpointError` unless every rank of the default group calls this (with the
    same ``op``) within ``timeout`` seconds of each other; a no-op without torch.distributed."""
    with arrival_checked(op, timeout):
        pass
