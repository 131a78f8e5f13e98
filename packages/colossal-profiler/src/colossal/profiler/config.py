"""Profiler configuration: the step schedule and which recorders run."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

__all__ = ["Action", "Schedule", "ProfilerConfig"]


class Action(enum.Enum):
    """What the profiler does during one step."""

    NONE = "none"
    """Nothing attached: no hooks, no observers; a step costs one counter increment."""
    WARMUP = "warmup"
    """Recorders attached and running, results thrown away (first-call effects settle)."""
    RECORD = "record"
    """Recorders attached; the step is kept."""
    RECORD_AND_SAVE = "record_and_save"
    """Last active step of a cycle: the step is kept and the cycle is written out."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Schedule:
    """Which steps are recorded, like ``torch.profiler.schedule``.

    After ``skip_first`` steps, cycles of ``wait`` idle, ``warmup`` discarded and ``active``
    recorded steps follow, ``repeat`` times (0: forever).
    """

    wait: int = 0
    """Steps with nothing attached at the start of each cycle."""
    warmup: int = 0
    """Steps recorded but discarded after the wait."""
    active: int = 1
    """Steps recorded and kept in each cycle."""
    repeat: int = 1
    """Number of cycles; 0 repeats forever."""
    skip_first: int = 0
    """Steps skipped once, before the first cycle."""

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "active", "repeat", "skip_first"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Schedule.{name} must be an int >= 0, got {value!r}")
        if self.active < 1:
            raise ValueError(f"Schedule.active must be >= 1, got {self.active}")

    @property
    def cycle(self) -> int:
        """Steps per cycle."""
        return self.wait + self.warmup + self.active

    def action(self, step: int) -> Action:
        """The action for step ``step`` (0-based)."""
        if step < self.skip_first:
            return Action.NONE
        step -= self.skip_first
        if self.repeat and step >= self.repeat * self.cycle:
            return Action.NONE
        pos = step % self.cycle
        if pos < self.wait:
            return Action.NONE
        if pos < self.wait + self.warmup:
            return Action.WARMUP
        return Action.RECORD_AND_SAVE if pos == self.cycle - 1 else Action.RECORD

    def cycle_index(self, step: int) -> int:
        """Index of the cycle that ``step`` belongs to (used to name output files)."""
        return max(step - self.skip_first, 0) // self.cycle


@dataclasses.dataclass(kw_only=True, slots=True)
class ProfilerConfig:
    """Everything a :class:`~colossal.profiler.Profiler` can be asked to do."""

    enabled: bool = True
    """False: the profiler attaches nothing, ever; ``step()`` only counts."""
    schedule: Schedule = dataclasses.field(default_factory=Schedule)
    """Which steps are recorded."""
    out_dir: str | None = None
    """Folder for traces, TensorBoard events and the JSONL summary; None keeps results in memory."""
    comm: bool = True
    """Record every ``colossal.comm`` collective (when colossal-comm is installed)."""
    memory: bool = True
    """Sample allocated memory at phase (and module) boundaries; record Gemini/ZeRO memory events."""
    phases: bool = True
    """Record forward/backward/optimizer spans (needs the model and/or optimizer)."""
    modules: bool = True
    """Record a span per module forward, down to ``module_depth``."""
    module_depth: int = 2
    """Deepest module level with spans: 1 = the model's children, 2 = their children, ..."""
    module_backward: bool = False
    """Also record module backward spans (full backward hooks: see ``module_backward.py`` for the caveats)."""
    flops: bool = False
    """Count FLOPs with ``torch.utils.flop_counter`` (costly: a dispatch mode on every op)."""
    straggler: bool = False
    """Gather collective durations across ranks at each recorded step: each rank's wait beyond the fastest."""
    trace: bool = True
    """Write a Chrome/Perfetto trace per rank and cycle (needs ``out_dir``)."""
    tensorboard: bool = True
    """Write TensorBoard scalars and text tables (needs ``out_dir``)."""
    summary: bool = True
    """Append one JSON line per recorded step to ``summary.rank<r>.jsonl`` (needs ``out_dir``)."""
    tokens_per_step: int | None = None
    """Tokens processed per step on this rank, for tokens/s."""
    peak_flops: float | None = None
    """Peak FLOP/s of this rank's device, for MFU (model FLOPs utilisation)."""
    sources: Sequence[Any] = ()
    """Extra event sources (objects with ``register_observer``) beyond the discovered ones."""
    discover: bool = True
    """Find ``colossal.comm``, ``colossal.zero`` and ``colossal.gemini`` via importlib when installed."""

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(self.schedule).__name__}")
        if not isinstance(self.module_depth, int) or self.module_depth < 0:
            raise ValueError(f"module_depth must be an int >= 0, got {self.module_depth!r}")
        for name in ("tokens_per_step", "peak_flops"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        for src in self.sources:
            if not callable(getattr(src, "register_observer", None)):
                raise TypeError(f"every source needs a callable register_observer, got {type(src).__name__}")
