"""What a checkpoint load raises, and what a non-strict load returns.

Every error here is an ordinary ``Exception`` (``except Exception`` catches it), raised on every
rank alike and before the model or optimizer is modified.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["CheckpointError", "CheckpointMismatchError", "IncompatibleEntries", "check_state_dict", "unreadable"]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or corrupted, or the ranks disagree on a save/load.

    ``path`` names the file (or directory) at fault, when there is one.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)

    def __reduce__(self):  # keep ``path`` across processes (pickle passes ``args`` alone)
        return type(self), (self.args[0], self.path)


class IncompatibleEntries(NamedTuple):
    """What a non-strict load skipped (like ``torch.nn.modules.module._IncompatibleKeys``).

    Entries are named like the checkpoint's keys without piece offsets: ``model/<name>``,
    ``optim/<name>/<state key>``.
    """

    missing: list[str]
    """Entries the model (or optimizer) has and the checkpoint does not (left as they were)."""
    unexpected: list[str]
    """Entries the checkpoint has and the model does not (ignored)."""
    mismatched: list[str]
    """``"<entry>: checkpoint (4, 6) float32, model (6, 4) float32"`` for every entry whose
    logical shape (or kind of dtype) differs. A load never skips these: they are always an error."""

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model: every missing, unexpected and mis-shaped entry at once.

    Also a ``ValueError`` (bad input, like ``load_state_dict``'s mismatch). ``entries`` holds the
    :class:`IncompatibleEntries`.
    """

    def __init__(self, path: str | os.PathLike, entries: IncompatibleEntries, hint: str = "") -> None:
        lines = [f"the checkpoint {str(path)!r} does not fit the model:"]
        for title, items in (("missing", entries.missing), ("unexpected", entries.unexpected),
                             ("mis-shaped", entries.mismatched)):  # fmt: skip
            if items:
                shown = ", ".join(items[:20]) + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")
                lines.append(f"  {len(items)} {title}: {shown}")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines), path)
        self.entries = entries
        self.hint = hint

    def __reduce__(self):
        return type(self), (self.path, self.entries, self.hint)


def unreadable(path: str | os.PathLike, what: str, cause: BaseException) -> CheckpointError:
    """The error for a file that cannot be read: names it, says why and what to do."""
    reason = f"{type(cause).__name__}: {cause}".strip().splitlines()[0][:300]
    return CheckpointError(
        f"cannot read {what} {str(path)!r} ({reason}); the file is truncated or corrupted: load an older "
        "checkpoint (see the 'latest' pointer of the checkpoint root) or save this one again",
        path,
    )


def check_state_dict(what: str, expected: dict[str, tuple], state: dict, strict: bool):
    """``torch.nn.Module.load_state_dict``'s check for an engine that loads a full state dict into
    its own storage: ``expected`` maps each key to its shape. Missing and unexpected keys are an
    error when ``strict`` (returned otherwise), a size mismatch always is; all listed in one
    ``RuntimeError`` worded as torch words it, before anything changes. Returns torch's
    ``_IncompatibleKeys``."""
    import torch

    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    errors = [
        f"size mismatch for {k}: copying a param with shape {state[k].shape} from checkpoint, "
        f"the shape in current model is {torch.Size(shape)}."
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != tuple(shape)
    ]
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {what}:\n\t" + "\n\t".join(errors))
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
