"""What each torchrun worker of ``colossalai run`` executes: the user's script (or ``-m`` module)
as ``__main__``, with its exception recorded for the launcher to print once.

``python -m colossalai.cli.run_worker [-m] TARGET [ARGS...]`` behaves like ``python [-m] TARGET
ARGS...`` (same ``sys.argv``, ``sys.path[0]`` and ``__name__``), except that an exception
escaping the script is written to ``$COLOSSALAI_CLI_ERRORS/rank<R>.txt`` and the process leaves at
once with exit code 1 ([Note: reporting rank failures once] in :mod:`colossalai.cli.rank_errors`).
``sys.exit(n)`` keeps its exit code and records nothing.
"""

from __future__ import annotations

import os
import runpy
import sys

from colossalai.cli.rank_errors import run_recording

__all__ = ["main"]


def _run(argv: list[str]) -> None:
    module = argv[:1] == ["-m"]
    target, *args = argv[1:] if module else argv
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    """Run the target; on an exception, record it (when the launcher asked) and leave at once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m colossalai.cli.run_worker [-m] TARGET [ARGS...]")
    run_recording(lambda: _run(argv))


if __name__ == "__main__":
    main()
