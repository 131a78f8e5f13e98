"""Live training progress: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from colossalai.cli.meters import Meters, format_bytes

__all__ = ["TrainProgress", "summary_table"]


def _status(step: int, total: int, loss: float, meters: Meters, extra: str = "") -> str:
    mem = " ".join(f"{tier}={format_bytes(b)}" for tier, b in meters.memory().items())
    line = (
        f"step {step}/{total} loss {loss:.6f} tok/s {meters.tokens_per_s():,.0f} "
        f"mem[{mem}] comm {format_bytes(meters.communicated())} tier-moves {format_bytes(meters.tier_moved())}"
    )
    return f"{line} {extra}" if extra else line


class TrainProgress:
    """Shows step, loss, tokens/s, memory per tier, bytes communicated and moved between tiers,
    and ETA (rank 0 only).

    ``mode``: ``"rich"`` (live bar), ``"plain"`` (one line per ``log_every`` steps, for logs and
    pipes) or ``"auto"`` (rich on a terminal).
    """

    def __init__(self, total: int, start: int, *, mode: str = "auto", log_every: int = 10, enabled: bool = True):
        if mode not in ("auto", "rich", "plain"):
            raise ValueError(f"progress mode must be 'auto', 'rich' or 'plain', got {mode!r}")
        self.total, self.log_every, self.enabled = total, max(1, log_every), enabled
        self.rich = enabled and (mode == "rich" or (mode == "auto" and sys.stdout.isatty()))
        self.console = Console()
        self._t0, self._start = time.perf_counter(), start
        if self.rich:
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.fields[status]}", markup=False),  # "mem[cpu=...]" is not a style tag
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, status="")
            self.bar.start()

    def update(self, step: int, loss: float, meters: Meters, extra: str = "") -> None:
        """Report the state after optimizer step ``step`` (1-based); ``extra`` is appended to the
        line (the MoE drop rate and expert load balance)."""
        if not self.enabled:
            return
        status = _status(step, self.total, loss, meters, extra)
        if self.rich:
            self.bar.update(self.task, completed=step, status=status)
        elif step % self.log_every == 0 or step == self.total or step == self._start + 1:
            done = step - self._start
            eta = (time.perf_counter() - self._t0) / max(done, 1) * (self.total - step)
            print(f"{status} eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        """Stop the live display."""
        if self.rich:
            self.bar.stop()


def summary_table(rows: dict[str, str], title: str = "colossalai train") -> Table:
    """A two-column rich table of the run's final figures."""
    table = Table(title=title, show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        table.add_row(key, value)
    return table
