"""One error message for a failed multi-process job, not one traceback per rank.

[Note: reporting rank failures once]
When ``colossalai train --nproc N`` relaunches itself under torchrun, or ``colossalai run`` starts a
script there (through :mod:`colossalai.cli.run_worker`), a rank that raises writes
its exception to ``<dir>/rank<R>.txt`` (a temporary folder), prints nothing and
leaves at once (``os._exit``), so that its peers fail or are stopped by torchrun within seconds.
The parent holds back torchrun's own failure report (its log lines and its ``ChildFailedError``
traceback), then prints the first failing rank's message as one line: ``colossalai train: error:
...`` in the CLI's words for a user's error ([Note: one line for a setup error] in
:mod:`colossalai.cli.user_errors`, exit code 2), else ``colossalai: rank R of N failed: Type:
message`` and a line saying how many ranks failed. The folder is removed when the run ends; with
``--debug`` the parent prints the first failing rank's traceback and keeps the folder. A failure
that wrote no file (a crash, a signal) shows torchrun's report unchanged. Under
``--max-restarts`` each attempt overwrites its ranks' files; only the last attempt's failures count.

A rank's file is plain text: ``key: value`` lines (``rank``, ``attempt``, ``time``, ``message``,
``cli`` when the CLI rewrote it), a blank line, then the traceback as Python prints it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import IO

__all__ = [
    "ERRORS_ENV",
    "RankError",
    "record_failure",
    "run_recording",
    "first_failure",
    "report_failure",
    "split_launcher_noise",
]

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
    cli: str = ""
    """The message in the command line's words (a user's error), or ``""``."""
    traceback: str = ""
    """The traceback, as Python prints it."""


def record_failure(exc: BaseException, folder: str | os.PathLike, cli: str | None = None) -> None:
    """Write ``exc`` of this rank to ``folder`` (see the module note; ``cli``: its message in the
    CLI's words, when it is a user's error); the caller then exits."""
    rank = int(os.environ.get("RANK", "0"))
    header = {
        "rank": rank,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "time": repr(time.time()),
        "message": " ".join(f"{type(exc).__name__}: {exc}".split()),
        "cli": " ".join((cli or "").split()),
    }
    lines = [f"{key}: {value}" for key, value in header.items() if value != ""]
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n\n" + "".join(traceback.format_exception(exc))
    pathlib.Path(folder, f"rank{rank}.txt").write_text(text)


def run_recording(fn: Callable[[], object], explain: Callable[[BaseException], str | None] | None = None) -> None:
    """Run ``fn``; under a launcher that asked for it (``$COLOSSALAI_CLI_ERRORS`` set), an exception
    is recorded with :func:`record_failure` (``explain``: its message in the CLI's words, or None)
    and the process leaves at once (exit code 1) without printing it. ``SystemExit`` and
    ``KeyboardInterrupt`` pass through."""
    folder = os.environ.get(ERRORS_ENV)
    if folder is None:
        fn()
        return
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, once, by the launcher
        record_failure(exc, folder, explain(exc) if explain is not None else None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _read(path: pathlib.Path) -> RankError | None:
    """The record in ``path``; None when unreadable (a rank killed while writing it)."""
    try:
        head, _, tb = path.read_text().partition("\n\n")
        fields = dict(line.split(": ", 1) for line in head.splitlines())
        rank, when, message = int(fields["rank"]), float(fields["time"]), fields["message"]
    except (OSError, ValueError, KeyError):
        return None
    return RankError(rank, when, message, path, int(fields.get("attempt", 0)), fields.get("cli", ""), tb)


def first_failure(folder: str | os.PathLike) -> tuple[RankError | None, int]:
    """The earliest recorded rank failure (ties: the lowest rank) of the last attempt, and how many
    ranks failed in it."""
    errors = [e for e in map(_read, sorted(pathlib.Path(folder).glob("rank*.txt"))) if e is not None]
    if not errors:
        return None, 0
    last = max(e.attempt for e in errors)
    errors = [e for e in errors if e.attempt == last]
    return min(errors, key=lambda e: (e.time, e.rank)), len(errors)


def report_failure(first: RankError, failed: int, nproc: int, *, command: str, debug: bool) -> int:
    """Print the failure of a job ([Note: reporting rank failures once]); returns its exit code
    (2: a user's error, 1: otherwise)."""
    if first.cli:
        print(f"colossalai {command}: error: {first.cli}", file=sys.stderr)
    else:
        print(f"colossalai: rank {first.rank} of {nproc} failed: {first.message}", file=sys.stderr)
    if debug:
        sys.stderr.write(first.traceback)
        print(f"colossalai: {failed} rank(s) failed; tracebacks kept in {first.path.parent}", file=sys.stderr)
    elif not first.cli:
        where = " before the script" if command == "run" else ""
        print(f"colossalai: {failed} rank(s) failed; add --debug{where} for the traceback", file=sys.stderr)
    return 2 if first.cli else 1


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
