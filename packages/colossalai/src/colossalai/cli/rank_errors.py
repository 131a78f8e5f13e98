"""One error message for a failed multi-process job, not one traceback per rank.

[Note: reporting rank failures once]
When ``colossalai train --nproc N`` relaunches itself under torchrun, or ``colossalai run`` starts a
script there (through :mod:`colossalai.cli.run_worker`), a rank that raises writes
its exception (time, one-line message, traceback) to ``<dir>/rank<R>.txt``, prints nothing and
leaves at once (``os._exit``), so that its peers fail or are stopped by torchrun within seconds.
The parent holds back torchrun's own failure report (its log lines and its ``ChildFailedError``
traceback), then prints the first failing rank's message as one line and where the tracebacks
are. A failure that wrote no file (a crash, a signal) shows torchrun's report unchanged. Under
``--max-restarts`` each attempt overwrites its ranks' files; only the last attempt's failures count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import IO

__all__ = ["ERRORS_ENV", "RankError", "record_failure", "run_recording", "first_failure", "split_launcher_noise"]

ERRORS_ENV = "COLOSSALAI_CLI_ERRORS"
"""Environment variable naming the folder where failing ranks write their exception."""

_LAUNCHER_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")  # glog-style torch.distributed.elastic logs


@dataclasses.dataclass(frozen=True, slots=True)
class RankError:
    """The exception one rank raised."""

    rank: int
    """Global rank."""
    time: float
    """``time.time()`` when it was caught."""
    message: str
    """``Type: message`` on one line."""
    path: pathlib.Path
    """The file holding it, with the full traceback."""
    attempt: int = 0
    """torchrun's restart count when it failed (``TORCHELASTIC_RESTART_COUNT``)."""


def record_failure(exc: BaseException, folder: str | os.PathLike) -> None:
    """Write ``exc`` of this rank to ``folder`` (see the module note); the caller then exits."""
    rank = int(os.environ.get("RANK", "0"))
    message = " ".join(f"{type(exc).__name__}: {exc}".split())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = {"rank": rank, "time": time.time(), "message": message, "traceback": traceback.format_exc()}
    record["attempt"] = attempt
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    path = pathlib.Path(folder, f"rank{rank}.txt")
    path.write_text(json.dumps(record) + "\n")


def run_recording(fn: Callable[[], object]) -> None:
    """Run ``fn``; under a launcher that asked for it (``$COLOSSAL_CLI_ERRORS`` set), an exception
    is recorded with :func:`record_failure` and the process leaves at once (exit code 1) without
    printing it. ``SystemExit`` and ``KeyboardInterrupt`` pass through."""
    folder = os.environ.get(ERRORS_ENV)
    if folder is None:
        fn()
        return
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, once, by the launcher
        record_failure(exc, folder)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _read(path: pathlib.Path) -> RankError | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return RankError(record["rank"], record["time"], record["message"], path, record.get("attempt", 0))


def first_failure(folder: str | os.PathLike) -> tuple[RankError | None, int]:
    """The earliest recorded rank failure (ties: the lowest rank) of the last attempt, and how many
    ranks failed in it."""
    errors = [e for e in map(_read, sorted(pathlib.Path(folder).glob("rank*.txt"))) if e is not None]
    if not errors:
        return None, 0
    last = max(e.attempt for e in errors)
    errors = [e for e in errors if e.attempt == last]
    return min(errors, key=lambda e: (e.time, e.rank)), len(errors)


def split_launcher_noise(lines: Iterable[str], out: IO[str] = sys.stderr) -> list[str]:
    """Copy ``lines`` (the launcher's stderr) to ``out`` as they come, except torchrun's own log
    lines and everything from the first traceback on: those are returned, to be shown only when
    no rank recorded its failure."""
    held: list[str] = []
    in_traceback = False  # the launcher's own exception (ChildFailedError) runs to the end
    for line in lines:
        in_traceback = in_traceback or line.startswith("Traceback (most recent call last)")
        if in_traceback or _LAUNCHER_LOG.match(line):
            held.append(line)
        else:
            out.write(line)
            out.flush()
    return held
