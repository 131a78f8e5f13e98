"""What a checkpoint load raises, and what a non-strict load returns: moved to
:mod:`colossal.comm.checkpoint.errors` (so that ZeRO and Gemini raise the same errors); this
module keeps the old import path working."""

from colossal.comm.checkpoint.errors import CheckpointError, CheckpointMismatchError, IncompatibleEntries, unreadable

__all__ = ["CheckpointError", "CheckpointMismatchError", "IncompatibleEntries", "unreadable"]
