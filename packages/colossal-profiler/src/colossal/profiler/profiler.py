"""The Profiler: a context manager with a step schedule that attaches the recorders.

[Note: nothing attached when off]
Recorders exist only while a step is recorded (warm-up or active). In wait steps, after the
schedule ends, and always with ``enabled=False``, the model, the optimizer and the comm/memory
event registries carry no hook or observer of ours, so the program runs exactly as without the
profiler; ``step()`` then only counts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from colossal.profiler import sources
from colossal.profiler.comm import CommRecorder, straggler_waits
from colossal.profiler.config import Action, ProfilerConfig
from colossal.profiler.intervals import StepFigures, step_figures
from colossal.profiler.memory import MemoryRecorder
from colossal.profiler.module_backward import BackwardModuleRecorder
from colossal.profiler.modules import ModuleRecorder
from colossal.profiler.optimizers import check_optimizer, inner_torch_optimizer
from colossal.profiler.outputs import Outputs
from colossal.profiler.phases import PhaseRecorder
from colossal.profiler.records import StepRecord
from colossal.profiler.spans import SpanOpener
from colossal.profiler.summary import comm_by_op, comm_by_site, comm_table, site_table, step_summary

__all__ = ["Profiler"]


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Profiler:
    """Profile steps of a training loop: collectives, memory, phases, modules, derived figures.

    ``model`` and ``optimizer`` are optional (phases and module spans need them); ``optimizer`` is a
    ``torch.optim.Optimizer`` or a wrapper of one with ``step()`` (a Booster's boosted optimizer,
    ``ZeroOptimizer``, ``GeminiOptimizer``: see [Note: wrapped optimizers]). Options are
    :class:`ProfilerConfig` fields, given either as ``config=`` or as keyword arguments. ``clock``
    replaces ``time.perf_counter`` (tests inject a fake one; comm and memory events carry
    ``perf_counter`` times, so a custom clock must agree with it when those are recorded).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        *,
        config: ProfilerConfig | None = None,
        clock: Callable[[], float] | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise TypeError(f"pass either config= or keyword options, not both (got {sorted(options)})")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        check_optimizer(optimizer)  # a torch optimizer or a wrapper of one: see [Note: wrapped optimizers]
        self.config = config if config is not None else ProfilerConfig(**options)
        """The options in force."""
        self.model, self.optimizer = model, optimizer
        self._clock = clock or time.perf_counter
        self.step_num = 0
        """Steps completed so far (``step()`` calls)."""
        self.steps: list[StepRecord] = []
        """Every kept step, all cycles."""
        self.figures: list[StepFigures] = []
        """Derived figures of every kept step."""
        self.summaries: list[dict[str, Any]] = []
        """The JSON summary line of every kept step."""
        self._current: StepRecord | None = None
        self._action = Action.NONE
        self._cycle: list[StepRecord] = []
        self._running = False
        self._handles: list[Any] = []
        self._recorders_built = False
        self._attached = False

    # ---- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Begin step 0 (a no-op when disabled)."""
        if not self.config.enabled or self._running:
            return
        self.rank, self.world_size = _rank_and_world()
        self.origin = self._clock()
        self._outputs = Outputs(self.config, self.rank)
        self._running = True
        self._begin_step()

    def step(self) -> None:
        """Mark the end of a training step (call once per iteration)."""
        if self._running:
            self._end_step(final=False)
            self.step_num += 1
            self._begin_step()
        else:
            self.step_num += 1

    def stop(self) -> None:
        """Finish the step in progress (kept if anything was recorded), write outputs, detach."""
        if not self._running:
            return
        self._end_step(final=True)
        self._detach()
        self._outputs.close()
        self._running = False

    @property
    def recording(self) -> bool:
        """True while the current step is being recorded (warm-up or active)."""
        return self._current is not None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A user-named phase span (``with prof.phase("data"): ...``); free when not recording."""
        if self._current is None or not self.config.phases:
            yield
            return
        with self._phases.phase(name):
            yield

    # ---- steps -----------------------------------------------------------------------------------

    def _begin_step(self) -> None:
        self._action = self.config.schedule.action(self.step_num)
        if self._action is Action.NONE:
            self._detach()
            self._current = None
            return
        self._current = StepRecord(step=self.step_num, start=self._clock())
        self._attach()
        if self.config.memory:
            self._memory.sample("step:start")

    def _end_step(self, *, final: bool) -> None:
        rec = self._current
        if rec is None:
            return
        if self.config.memory:
            self._memory.sample("step:end")
        rec.end = self._clock()
        self._current = None
        if self.config.modules or self.config.flops:
            rec.flops = self._modules.stop_counting()
        if self.config.straggler and self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, [(c.ranks, c.duration) for c in rec.comm])
            straggler_waits(rec.comm, gathered)
        if self._action is not Action.WARMUP and not (final and rec.empty):
            self._keep(rec)
        if self._cycle and (self._action is Action.RECORD_AND_SAVE or final):
            self._outputs.cycle(self._cycle, self.config.schedule.cycle_index(self._cycle[0].step), self.origin)
            self._cycle = []

    def _keep(self, rec: StepRecord) -> None:
        figures = step_figures(rec, tokens=self.config.tokens_per_step, peak_flops=self.config.peak_flops)
        summary = step_summary(rec, figures, self.rank, self.world_size)
        self.steps.append(rec)
        self.figures.append(figures)
        self.summaries.append(summary)
        self._cycle.append(rec)
        self._outputs.step(summary)

    # ---- recorders -------------------------------------------------------------------------------

    def _build(self) -> None:
        cfg, current = self.config, lambda: self._current
        self._spans = SpanOpener(current, self._clock)
        self._memory = MemoryRecorder(current, self._clock, self.model, inner_torch_optimizer(self.optimizer))
        self._comm = CommRecorder(lambda: self._current.comm if self._current is not None else None)
        # Model data changes when gradients appear or go and when optimizer states are made: recount
        # only at the ends of backward and optimizer (and at step boundaries); elsewhere reuse it.
        recount = ("backward:end", "optimizer:end")
        phase_boundary = (lambda label: self._memory.sample(label, recount=label in recount)) if cfg.memory else None
        module_boundary = (lambda label: self._memory.sample(label, recount=False)) if cfg.memory else None
        self._phases = PhaseRecorder(self._spans, phase_boundary)
        self._modules = ModuleRecorder(self._spans, module_boundary, cfg.flops)
        self._modules_bwd = BackwardModuleRecorder(self._spans)
        self._recorders_built = True

    def _attach(self) -> None:
        if self._attached:
            return
        self._attached = True
        if not self._recorders_built:
            self._build()
        cfg = self.config
        names = ([sources.COMM] if cfg.comm else []) + (list(sources.MEMORY_SOURCES) if cfg.memory else [])
        found = [m for m in map(sources.optional_module, names if cfg.discover else []) if m is not None]
        for src in [*found, *cfg.sources]:
            self._handles.append(src.register_observer(self._router(getattr(src, "__name__", type(src).__name__))))
        if cfg.phases:
            self._phases.attach(self.model, self.optimizer)
        if self.model is not None and (cfg.modules or cfg.flops):
            self._modules.attach(self.model, cfg.module_depth if cfg.modules else 0)
        if self.model is not None and cfg.module_backward:
            self._modules_bwd.attach(self.model, cfg.module_depth)

    def _router(self, source: str) -> Callable[[Any], None]:
        comm, memory = self.config.comm, self.config.memory

        def route(event: Any) -> None:
            if getattr(event, "kind", None) is not None:
                if memory:
                    self._memory.observe(event, source)
            elif comm and hasattr(event, "op"):
                self._comm(event)

        return route

    def _detach(self) -> None:
        self._attached = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._recorders_built:
            self._phases.detach()
            self._modules.detach()
            self._modules_bwd.detach()

    # ---- tables ----------------------------------------------------------------------------------

    def comm_table(self) -> str:
        """Per-op communication table over every kept step."""
        return comm_table(comm_by_op([c for rec in self.steps for c in rec.comm]))

    def site_table(self) -> str:
        """Per-call-site communication table over every kept step."""
        return site_table(comm_by_site([c for rec in self.steps for c in rec.comm]))
