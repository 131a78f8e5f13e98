"""Collective-sequence checking: find the first collective on which ranks disagree.

A program whose ranks issue different collectives (rank 0 an ``all_reduce`` where rank 1 issues
a ``broadcast``, two ranks reducing tensors of different shapes, a rank skipping a collective)
hangs or silently computes garbage. With checking on, every collective issued through
``colossal.comm`` first publishes a fingerprint of itself (operation, reduction or root, shape,
dtype, group, call site) in the process group's key-value store and compares it with the
fingerprints of the other ranks of the group *before* the collective is issued, so a divergence
raises :class:`CollectiveMismatchError` on every rank that reached it, naming each rank's
operation and call site, and never hangs.

Turn it on with the environment variable ``COLOSSAL_COMM_DEBUG=1`` (read at import) or
:func:`set_debug`. Off, the cost is one branch per collective.

[Note: how the sequence check works]
Each process counts the collectives it issued per process group (``group_name``, which every
member agrees on because groups are created in the same order everywhere). Collective number
``k`` on group ``g`` writes its fingerprint under ``colossal.comm.debug/<g>/<k>/<rank>`` and waits
for the same key of every other member. All earlier collectives matched (or an error would have
been raised), so the first mismatching ``k`` is the first divergence. A member that never writes
its key (it issues its collective on another group, or stopped issuing) is detected after
``timeout`` seconds; the error then shows that rank's latest collective, which every rank also
publishes under ``colossal.comm.debug/last/<rank>``. Point-to-point operations (``send``,
``recv``, ``batch_p2p``) are not collectives and are not checked. The keys stay in the store for
the life of the process group: debug mode is for finding a bug, not for long runs.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["CollectiveMismatchError", "set_debug", "debug_enabled", "check_collective"]

_ENV = "COLOSSAL_COMM_DEBUG"
_ENV_TIMEOUT = "COLOSSAL_COMM_DEBUG_TIMEOUT"
_PREFIX = "colossal.comm.debug"
_P2P = frozenset({"send", "recv", "batch_p2p"})
_COMPARED = ("op", "detail", "shape", "dtype", "ranks")
_THIS_PACKAGE = os.path.dirname(os.path.abspath(__file__))

ENABLED: bool = os.environ.get(_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")
"""Whether collectives are checked (the one branch in ``collectives._issue`` reads this)."""
_timeout_s: float = float(os.environ.get(_ENV_TIMEOUT, "300"))
_counters: defaultdict[str, int] = defaultdict(int)


class CollectiveMismatchError(RuntimeError):
    """Ranks of a process group issued different collectives (or one never issued its own)."""


def set_debug(enabled: bool = True, timeout: float | None = None) -> None:
    """Turn collective-sequence checking on or off in this process (every rank must agree).

    ``timeout`` (seconds, default 300 or ``COLOSSAL_COMM_DEBUG_TIMEOUT``) is how long a rank
    waits for the other ranks to reach the same collective before it reports the missing ones.
    """
    global ENABLED, _timeout_s
    if timeout is not None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        _timeout_s = float(timeout)
    ENABLED = bool(enabled)


def debug_enabled() -> bool:
    """True while collective-sequence checking is on."""
    return ENABLED


def _call_site() -> str:
    """``file:line in function`` of the innermost frame outside ``colossal.comm``."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _THIS_PACKAGE:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _describe(fp: dict) -> str:
    detail = f"({fp['detail']})" if fp["detail"] else ""
    return f"{fp['op']}{detail} {fp['dtype']}{fp['shape']} on ranks {fp['ranks']} at {fp['site']}"


def _format_detail(detail: tuple) -> str:
    """``(("op", "sum"), ("dim", 0))`` -> ``"sum, dim=0"`` (a reduction shows by its name alone)."""
    parts = []
    for key, value in detail:
        if key == "op":
            parts.append(value if isinstance(value, str) else str(value).rsplit(".", 1)[-1].lower())
        else:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def check_collective(
    name: str, group: ProcessGroup | None, tensor: torch.Tensor, detail: tuple = (), shape: list | None = None
) -> None:
    """Compare this collective with the other ranks' collective of the same sequence number
    (see ``[Note: how the sequence check works]``); raise :class:`CollectiveMismatchError` on a
    divergence. Called by every ``colossal.comm`` collective while debug mode is on; ``detail``
    holds ``(name, value)`` pairs (reduction, root, dims) that must also agree."""
    if name in _P2P or not dist.is_initialized():
        return
    group = group if group is not None else dist.group.WORLD
    ranks = list(dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return
    gname = group.group_name
    _counters[gname] += 1
    seq, me = _counters[gname], dist.get_rank()
    fp = {
        "op": name,
        "detail": _format_detail(detail),
        "shape": list(tensor.shape) if shape is None else list(shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "ranks": ranks,
        "site": _call_site(),
        "seq": seq,
    }
    store = dist.distributed_c10d._get_default_store()
    payload = json.dumps(fp)
    store.set(f"{_PREFIX}/last/{me}", payload)
    store.set(f"{_PREFIX}/{gname}/{seq}/{me}", payload)
    others = {r: _wait_for(store, gname, seq, r, fp) for r in ranks if r != me}
    mismatched = {r: o for r, o in others.items() if any(o[k] != fp[k] for k in _COMPARED)}
    if mismatched:
        lines = "".join(f"\n  rank {r}: {_describe(o)}" for r, o in sorted({**mismatched, me: fp}.items()))
        raise CollectiveMismatchError(
            f"ranks issued different collectives at collective #{seq} of their process group "
            f"(the first divergence; every earlier one matched):{lines}"
        )


def _wait_for(store: dist.Store, gname: str, seq: int, rank: int, mine: dict) -> dict:
    """The fingerprint rank ``rank`` wrote for collective ``seq`` of ``gname``, waiting up to the
    debug timeout; on timeout, an error showing that rank's latest collective."""
    key = f"{_PREFIX}/{gname}/{seq}/{rank}"
    try:
        store.wait([key], datetime.timedelta(seconds=_timeout_s))
    except Exception as exc:  # noqa: BLE001 - every store reports a timeout differently
        last_key = f"{_PREFIX}/last/{rank}"
        last = json.loads(store.get(last_key)) if store.check([last_key]) else None
        where = f"its latest was #{last['seq']} of its group: {_describe(last)}" if last else "it issued none"
        raise CollectiveMismatchError(
            f"rank {rank} did not reach collective #{seq} within {_timeout_s:.0f} s "
            f"(COLOSSAL_COMM_DEBUG_TIMEOUT) while rank {dist.get_rank()} waits in {_describe(mine)}; "
            f"{where}"
        ) from exc
    return json.loads(store.get(key))
