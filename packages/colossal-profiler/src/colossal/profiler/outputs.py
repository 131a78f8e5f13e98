"""Writing results: JSONL summary, TensorBoard scalars and tables, Chrome traces (per rank)."""

from __future__ import annotations

import json
import os
from typing import Any

from colossal.profiler.chrome import write_trace
from colossal.profiler.config import ProfilerConfig
from colossal.profiler.records import StepRecord
from colossal.profiler.summary import FIGURE_UNITS, comm_by_op, comm_by_site, comm_table, site_table
from colossal.profiler.tbevents import EventWriter

__all__ = ["Outputs", "summary_path", "trace_path", "tensorboard_dir"]


def summary_path(out_dir: str, rank: int) -> str:
    """``<out_dir>/summary.rank<r>.jsonl``."""
    return os.path.join(out_dir, f"summary.rank{rank}.jsonl")


def trace_path(out_dir: str, rank: int, cycle: int) -> str:
    """``<out_dir>/trace.rank<r>.cycle<c>.json.gz``."""
    return os.path.join(out_dir, f"trace.rank{rank}.cycle{cycle}.json.gz")


def tensorboard_dir(out_dir: str, rank: int) -> str:
    """``<out_dir>/tensorboard/rank<r>`` (one TensorBoard run per rank)."""
    return os.path.join(out_dir, "tensorboard", f"rank{rank}")


class Outputs:
    """The files of one rank; nothing is written when ``config.out_dir`` is None."""

    def __init__(self, config: ProfilerConfig, rank: int) -> None:
        self._config, self._rank = config, rank
        self._dir = config.out_dir
        self._tb: EventWriter | None = None
        self._jsonl: Any = None  # the summary file, opened once and flushed per step
        if self._dir is not None:
            os.makedirs(self._dir, exist_ok=True)

    def step(self, summary: dict[str, Any]) -> None:
        """Write one recorded step: a JSONL line and its scalars."""
        if self._dir is None:
            return
        if self._config.summary:
            if self._jsonl is None:
                self._jsonl = open(summary_path(self._dir, self._rank), "a", encoding="utf-8")  # noqa: SIM115
            self._jsonl.write(json.dumps(summary) + "\n")
            self._jsonl.flush()
        if self._config.tensorboard:
            scalars = {f"profiler/{k}": summary[k] for k in FIGURE_UNITS if summary.get(k) is not None}
            for op, totals in summary["comm_by_op"].items():
                scalars[f"profiler/comm/{op}/time"] = totals["time"]
                scalars[f"profiler/comm/{op}/busbw"] = totals["busbw"]
            self._writer().scalars(summary["step"], scalars)

    def cycle(self, steps: list[StepRecord], cycle: int, origin: float) -> None:
        """Write a finished cycle: its trace and its communication tables."""
        if self._dir is None or not steps:
            return
        if self._config.trace:
            write_trace(trace_path(self._dir, self._rank, cycle), steps, self._rank, origin)
        if self._config.tensorboard:
            records = [c for rec in steps for c in rec.comm]
            last = steps[-1].step
            self._writer().text(last, "profiler/comm_by_op", comm_table(comm_by_op(records)))
            self._writer().text(last, "profiler/comm_by_site", site_table(comm_by_site(records)))
            self._writer().flush()

    def _writer(self) -> EventWriter:
        if self._tb is None:
            self._tb = EventWriter(tensorboard_dir(self._dir, self._rank))
        return self._tb

    def close(self) -> None:
        """Close the summary and TensorBoard files."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
