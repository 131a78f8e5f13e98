"""Engine errors under ``colossalai train`` told in the command line's words.

[Note: one line for a setup error]
The engines word their errors for Python callers (``raise device_memory_budget or lower
chunk_size``). Under ``colossalai train`` the same failure is a bad command line, so
:func:`cli_message` rewrites it as one line naming the CLI flags: a device-budget error
(Gemini's ``BudgetExceededError``) says which budget is too small, by how much and what to pass
instead, keeping only the advice the CLI can follow (no ``--chunk-size`` or ``--prefetch`` flag
exists, so that advice is dropped); a ``ValueError`` / ``NotImplementedError`` (the project's
errors for users, STYLE.md) has its Python argument names replaced by the flags. Any other
exception is a bug, and keeps its traceback. The CLI prints the line with exit code 2 (a bad
argument); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import re

from colossalai.cli.meters import format_bytes

__all__ = ["PYTHON_TO_FLAG", "cli_message", "flag_names"]

PYTHON_TO_FLAG = {
    "device_memory_budget": "--device-budget",
    "host_memory_budget": "--host-budget",
    "disk_dir": "--disk-dir",
    "num_microbatches": "--microbatches",
    "mixed_precision": "--precision",
    "placement='auto'": "--placement auto",
    "placement='static'": "--placement static",
    "the batch size": "--batch-size",
    **{name: "--" + name.replace("_", "-") for name in ("tp_size", "tp_mode", "tp_depth", "sp_size", "sp_kind")},
    **{name: "--" + name.replace("_", "-") for name in ("pp_size", "pp_schedule", "pp_virtual", "ep_size")},
}
"""Python argument names in engine messages -> the ``colossalai train`` flag that sets them."""

_NOT_FLAGS = ("chunk_size", "prefetch", "offload_param_frac", "offload_optim_frac", "disk_param_frac", "disk_grad_frac",
              "disk_optim_frac")  # fmt: skip
"""Engine settings the CLI does not expose: advice naming them is dropped."""

_NEED = re.compile(r"need (\d+) bytes")
_BUDGET = re.compile(r"budget (\d+)( bytes)?")
_MODEL = re.compile(r"(?<=model )\d+")


def flag_names(text: str) -> str:
    """``text`` on one line with the Python argument names of :data:`PYTHON_TO_FLAG` as flags."""
    text = " ".join(text.split())
    for name, flag in PYTHON_TO_FLAG.items():
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w])", flag, text)
    return text


def _advice(advice: str, need: int, args: argparse.Namespace) -> list[str]:
    """What to change, in flags: a large enough ``--device-budget`` first, then the engine's other
    tips (``raise X, lower Y or Z``) that the CLI can follow."""
    tips = [f"raise --device-budget to at least {format_bytes(need)}"]
    for tip in re.split(r", (?:or )?| or ", advice):
        if "device_memory_budget" not in tip and not any(name in tip for name in _NOT_FLAGS):
            tips.append(flag_names(tip))
    if args.activation_checkpointing is False:
        tips.append("drop --no-activation-checkpointing (activations count in the budget)")
    return tips


def _budget_message(text: str, args: argparse.Namespace) -> str | None:
    """``--device-budget 1KiB is too small: need 231.0 KiB more (...); raise --device-budget ...``."""
    what, _, advice = " ".join(text.split()).partition("; ")
    need, budget = _NEED.search(what), _BUDGET.search(what)
    if need is None or budget is None:
        return None
    need, budget = int(need[1]), int(budget[1])
    what = _NEED.sub(lambda m: format_bytes(int(m[1])), what)
    what = _BUDGET.sub(lambda m: f"budget {format_bytes(int(m[1]))}", what)
    what = _MODEL.sub(lambda m: format_bytes(int(m[0])), what)
    given = f"--device-budget {args.device_budget}" if args.device_budget else "the default device budget"
    *tips, last = _advice(advice, need, args)
    tips = ", ".join(tips) + " or " + last if tips else last
    return f"{given} is too small: need {format_bytes(need - budget)} more ({what}); {tips}"


def cli_message(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The one line ``colossalai train`` prints for ``exc`` ([Note: one line for a setup error]),
    or None when ``exc`` is not a user's error (its traceback is then shown as usual)."""
    from colossal.gemini import BudgetExceededError

    if isinstance(exc, BudgetExceededError) and not str(exc).startswith("host tier"):
        message = _budget_message(str(exc), args)
        return message if message is not None else flag_names(str(exc))
    if isinstance(exc, (ValueError, NotImplementedError)):
        return flag_names(str(exc))
    return None
