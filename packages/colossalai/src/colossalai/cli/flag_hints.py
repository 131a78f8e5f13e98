"""Hints for flags a sub-command does not know: the closest of its own flags, and what torchrun's
spellings (``--nproc_per_node``, ``--nnodes``, ...) are called here.

``colossalai train --devce-budget 1KiB`` ends as argparse ends (exit code 2) with, on the same
line, ``did you mean --device-budget?``: a flag written with underscores is matched to its dashed
spelling first, then :func:`difflib.get_close_matches` picks among the sub-command's flags.
"""

from __future__ import annotations

import argparse
import difflib

__all__ = ["TORCHRUN_HINTS", "unknown_flag_hints"]

_ONE_HOST = "colossalai train runs on this host only (--nproc N); several hosts: colossalai run --hostfile FILE"
_HOSTFILE = "colossalai run takes the hosts from --hostfile FILE ('host [slots=N]' lines; the first is the master)"

TORCHRUN_HINTS: dict[str, dict[str, str]] = {
    "nproc-per-node": {"train": "colossalai train calls it --nproc", "run": "colossalai run calls it --nproc"},
    "nnodes": {"train": _ONE_HOST, "run": _HOSTFILE},
    "node-rank": {"train": _ONE_HOST, "run": _HOSTFILE},
    "master-addr": {"train": _ONE_HOST, "run": _HOSTFILE},
    "master-port": {
        "train": "colossalai train --nproc N needs no port (its ranks meet on this host, as torchrun --standalone)",
        "run": "colossalai run calls it --master-port",
    },
}
"""torchrun option (dashed, without ``--``) -> sub-command -> what to write instead."""


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option string of ``parser``."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def _hint(flag: str, command: str, known: list[str]) -> str | None:
    """What to write instead of ``flag`` (``--name`` or ``--name=value``), or None."""
    name = flag.split("=", 1)[0]
    dashed = name[2:].replace("_", "-")
    torchrun = TORCHRUN_HINTS.get(dashed, {}).get(command)
    if f"--{dashed}" in known:
        return f"did you mean --{dashed}?"
    if torchrun is not None:
        return f"{name} is torchrun's spelling: {torchrun}"
    close = difflib.get_close_matches(f"--{dashed}", known, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else None


def unknown_flag_hints(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> list[str]:
    """One hint per unknown flag in ``extras`` that has one (``parser``: the sub-command's)."""
    known = _flags(parser)
    hints = []
    for flag in (e for e in extras if e.startswith("--")):
        hint = _hint(flag, command, known)
        if hint is not None:
            hints.append(hint)
    return hints
