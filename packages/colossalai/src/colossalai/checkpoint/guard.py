"""Every rank must save and load: detect the ``if rank == 0: booster.save_model(...)`` mistake.

[Note: the arrival check]
Saving and loading are collectives in every engine (gathers, DCP's plan exchange, barriers). A
call on some ranks only hangs in the first of them, on NCCL for the process group's whole timeout,
with no hint. So each Booster checkpoint call first runs :func:`check_all_ranks_arrive`: every rank
writes ``<op>`` under a per-process sequence number into the default process group's key-value
store and waits for the keys of all ranks. The store works the same under gloo and NCCL, needs no
extra process group (creating one would itself be a collective) and no GPU. When the keys do not
all arrive within the timeout, each waiting rank raises a :class:`CheckpointError` naming the
ranks that never arrived; when they arrive with different operations (rank 0 saves while rank 1
loads), it names those. A rank that arrives late but within the timeout (it was still evaluating)
is no error. The cost is one store round trip per rank per checkpoint call.
"""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist

from colossalai.checkpoint.errors import CheckpointError

__all__ = ["check_all_ranks_arrive", "DEFAULT_ARRIVAL_TIMEOUT"]

DEFAULT_ARRIVAL_TIMEOUT = 300.0
"""Seconds a checkpoint call waits for every rank before it raises (Booster ``checkpoint_timeout``)."""

_sequence = itertools.count()


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def check_all_ranks_arrive(op: str, timeout: float = DEFAULT_ARRIVAL_TIMEOUT) -> None:
    """Raise :class:`CheckpointError` unless every rank of the default group calls this (with the
    same ``op``) within ``timeout`` seconds of each other; a no-op without torch.distributed."""
    if timeout <= 0:
        raise ValueError(f"the checkpoint arrival timeout must be positive, got {timeout}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    if store is None:  # no reachable store: fall back to gloo's monitored barrier (rank 0 names the missing)
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        return
    prefix = f"colossalai/checkpoint/{next(_sequence)}"
    store.set(f"{prefix}/{rank}", op)
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # DistStoreError/RuntimeError on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
        raise CheckpointError(
            f"{op} on rank {rank}: ranks {missing} did not call it within {timeout:g} s. Saving and loading "
            "are collective: call them on every rank (not under 'if rank == 0:'); a rank that is legitimately "
            "slower needs a larger Booster(checkpoint_timeout=...)"
        ) from e
    ops = {r: store.get(k).decode() for r, k in enumerate(keys)}
    if len(set(ops.values())) > 1:
        raise CheckpointError(f"the ranks called different checkpoint operations at the same point: {ops}")
