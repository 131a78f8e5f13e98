"""Arrival checks: detect a collective that only some ranks call, instead of hanging in it.

[Note: the arrival check]
Saving and loading a sharded engine are collectives (all-gathers, DCP's plan exchange, barriers).
Called on some ranks only (``if rank == 0: engine.state_dict()``), they hang in the first
collective, on NCCL for the process group's whole timeout, with no hint. :func:`check_arrival`
runs first: every member of the group writes ``<op>`` under a per-group sequence number into the
default process group's key-value store and waits for the keys of the other members. The store
works the same under gloo and NCCL, needs no extra process group (creating one would itself be a
collective) and no GPU. When the keys do not all arrive within the timeout, each waiting rank
raises an error naming the ranks that never arrived; when they arrive with different operations
(rank 0 saves while rank 1 loads), it names those. A rank that arrives late but within the
timeout (it was still evaluating) is no error. The cost is one store round trip per rank.

Sequence numbers count per group (``group_name``, which every member agrees on because groups
are created in the same order everywhere). A rank that reaches check ``k + 1`` knows every member
finished check ``k - 1`` (they wrote key ``k`` after it), so it deletes its own key of check
``k - 1``: the store holds at most two keys per rank and group however long the run.

:func:`monitored` runs the check once for a whole call: a check nested inside a monitored call
(``state_dict()`` calling ``full_optimizer_state_dict``) is skipped, the same way on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.comm.launch import resolve_timeout

__all__ = [
    "ArrivalError",
    "DEFAULT_ARRIVAL_TIMEOUT",
    "check_arrival",
    "monitored",
    "monitored_call",
    "resolve_arrival_timeout",
]

DEFAULT_ARRIVAL_TIMEOUT = 300.0
"""Seconds a monitored collective waits for every rank before it raises, unless the caller or
``COLOSSAL_COMM_TIMEOUT`` says otherwise."""

_PREFIX = "colossal.comm.arrival"
_counters: defaultdict[str, int] = defaultdict(int)
_depth = threading.local()


class ArrivalError(RuntimeError):
    """Some ranks of a group did not call a collective within the timeout, or called another one.

    ``missing`` lists the ranks (global) that never arrived (empty when they arrived with
    different operations).
    """

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


def resolve_arrival_timeout(timeout: float | None = None) -> float:
    """``timeout`` if given, else ``COLOSSAL_COMM_TIMEOUT`` (the process-group timeout of
    ``launch()``: a collective would fail then anyway), else :data:`DEFAULT_ARRIVAL_TIMEOUT`;
    ``ValueError`` naming the source for a value that is not a positive number."""
    if timeout is None and not os.environ.get("COLOSSAL_COMM_TIMEOUT", "").strip():
        return DEFAULT_ARRIVAL_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, type(None))):
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    return resolve_timeout(timeout)  # launch()'s rules: the value, else the environment variable


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def check_arrival(
    op: str,
    group: ProcessGroup | None = None,
    timeout: float | None = None,
    *,
    error: type[Exception] = ArrivalError,
    hint: str = "",
) -> None:
    """Raise unless every rank of ``group`` (default: the world) calls this with the same ``op``
    within ``timeout`` seconds (:func:`resolve_arrival_timeout`) of each other; see [Note: the
    arrival check]. A no-op without torch.distributed or for a group of one.

    ``error``: the exception type raised (``ArrivalError`` or a subclass, or any type taking the
    message as its only argument); ``hint`` ends its message (what the user should do).
    """
    timeout = resolve_arrival_timeout(timeout)
    if not dist.is_initialized():
        return
    group = group if group is not None else dist.group.WORLD
    ranks = list(dist.get_process_group_ranks(group))
    store, me = _store(), dist.get_rank()
    if len(ranks) == 1 or me not in ranks:
        return
    if store is None:  # no reachable store: gloo's monitored barrier names the missing ranks on rank 0
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        return
    gname = group.group_name
    _counters[gname] += 1
    seq = _counters[gname]
    store.set(f"{_PREFIX}/{gname}/{seq}/{me}", op)
    _forget(store, f"{_PREFIX}/{gname}/{seq - 2}/{me}")
    keys = [f"{_PREFIX}/{gname}/{seq}/{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - DistStoreError / RuntimeError: every store reports a timeout its own way
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        if not missing:
            raise
        _raise(error, f"{op} on rank {me}: ranks {missing} did not call it within {timeout:g} s", hint, missing, e)
    ops = {r: store.get(k).decode() for r, k in zip(ranks, keys, strict=True)}
    if len(set(ops.values())) > 1:
        _raise(error, f"the ranks called different operations at the same point: {ops}", hint, [], None)


def _forget(store, key: str) -> None:
    with contextlib.suppress(Exception):  # a store without delete_key keeps the key: harmless
        store.delete_key(key)


def _raise(error: type[Exception], message: str, hint: str, missing: list[int], cause) -> None:
    text = f"{message}. {hint}" if hint else message
    exc = error(text, missing) if issubclass(error, ArrivalError) else error(text)
    raise exc from cause


@contextlib.contextmanager
def monitored_call(
    op: str,
    group: ProcessGroup | None = None,
    timeout: float | None = None,
    *,
    error: type[Exception] = ArrivalError,
    hint: str = "",
) -> Iterator[None]:
    """Run :func:`check_arrival` on entry, unless already inside a monitored call of this thread;
    checks nested inside the block are skipped (one check per user-facing call)."""
    depth = getattr(_depth, "value", 0)
    if depth == 0:
        check_arrival(op, group, timeout, error=error, hint=hint)
    _depth.value = depth + 1
    try:
        yield
    finally:
        _depth.value = depth


def monitored(
    op: str,
    where: Callable[..., tuple[ProcessGroup | None, float | None]],
    *,
    error: type[Exception] = ArrivalError,
    hint: str = "",
) -> Callable:
    """Decorator: the function is a collective; ``where(*args, **kwargs)`` returns ``(group,
    timeout)`` for the call, and :func:`monitored_call` guards it."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            group, timeout = where(*args, **kwargs)
            with monitored_call(op, group, timeout, error=error, hint=hint):
                return fn(*args, **kwargs)

        return run

    return wrap
