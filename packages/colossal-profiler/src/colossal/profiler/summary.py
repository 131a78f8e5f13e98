"""Per-step summaries: JSON-ready dicts, per-op and per-call-site tables, text formatting."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from colossal.profiler.intervals import StepFigures
from colossal.profiler.records import CommRecord, StepRecord

__all__ = ["comm_by_op", "comm_by_site", "step_summary", "format_table", "comm_table", "site_table", "FIGURE_UNITS"]

FIGURE_UNITS = {
    "step_time": "s",
    "compute": "s",
    "comm": "s",
    "overlap": "s",
    "exposed_comm": "s",
    "idle": "s",
    "straggler_wait": "s",
    "comm_bytes": "B",
    "wire_bytes": "B",
    "peak_memory": "B",
    "flops_per_s": "FLOP/s",
    "tokens_per_s": "tok/s",
    "mfu": "",
}
"""The per-step figures written as scalars, with their units."""


def _totals(records: Iterable[CommRecord]) -> dict[str, float]:
    calls = nbytes = wire = time = 0.0
    for c in records:
        calls, nbytes, wire, time = calls + 1, nbytes + c.nbytes, wire + c.wire_bytes, time + c.duration
    return {
        "calls": int(calls),
        "bytes": int(nbytes),
        "wire_bytes": wire,
        "time": time,
        "algbw": nbytes / time if time > 0 else 0.0,
        "busbw": wire / time if time > 0 else 0.0,
    }


def comm_by_op(records: Sequence[CommRecord]) -> dict[str, dict[str, float]]:
    """Totals per op: calls, bytes, wire bytes, time, and the aggregate algbw/busbw (bytes/s)."""
    groups: dict[str, list[CommRecord]] = defaultdict(list)
    for c in records:
        groups[c.op].append(c)
    return {op: _totals(group) for op, group in sorted(groups.items())}


def comm_by_site(records: Sequence[CommRecord]) -> list[dict[str, Any]]:
    """Totals per (call site, op, group size), largest time first."""
    groups: dict[tuple[str, str, int], list[CommRecord]] = defaultdict(list)
    for c in records:
        groups[(c.caller, c.op, c.group_size)].append(c)
    rows = [{"caller": k[0], "op": k[1], "group_size": k[2], **_totals(g)} for k, g in groups.items()]
    return sorted(rows, key=lambda row: -row["time"])


def step_summary(rec: StepRecord, figures: StepFigures, rank: int, world_size: int) -> dict[str, Any]:
    """One JSON-ready line for the summary file."""
    phases: dict[str, float] = defaultdict(float)
    modules: dict[str, dict[str, dict[str, float]]] = {"modules": {}, "modules_backward": {}}
    for s in rec.spans:
        if s.track == "phases":
            phases[s.name] += s.duration
        else:
            entry = modules[s.track].setdefault(s.name, {"time": 0.0, "calls": 0, "flops": 0})
            entry["time"] += s.duration
            entry["calls"] += 1
            entry["flops"] += s.args.get("flops", 0)
    peak: dict[str, int] = {}
    for m in rec.memory:
        peak[m.tier] = max(peak.get(m.tier, 0), m.model_bytes + m.non_model_bytes)
    moves: dict[tuple[str, str, str], dict[str, float]] = {}
    for mv in rec.moves:
        entry = moves.setdefault((mv.src, mv.dst, mv.reason), {"moves": 0, "bytes": 0, "time": 0.0})
        entry["moves"] += 1
        entry["bytes"] += mv.nbytes
        entry["time"] += max(mv.end - mv.start, 0.0)
    return {
        "step": rec.step,
        "rank": rank,
        "world_size": world_size,
        **{f.name: getattr(figures, f.name) for f in dataclasses.fields(figures)},  # shallow: all plain numbers
        "phases": dict(phases),
        **modules,
        "peak_memory_by_tier": peak,
        "chunk_move_bytes": sum(m.nbytes for m in rec.moves),
        "chunk_moves": [{"src": k[0], "dst": k[1], "reason": k[2], **v} for k, v in sorted(moves.items())],
        "comm_by_op": comm_by_op(rec.comm),
        "comm_by_site": comm_by_site(rec.comm),
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table (readable as plain text and in TensorBoard's text tab)."""
    lines = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(headers)]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    out = [fmt.format(*headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [fmt.format(*line) for line in lines])


def comm_table(by_op: dict[str, dict[str, float]]) -> str:
    """Per-op table (times in ms, bandwidths in GB/s)."""
    headers = ("op", "calls", "bytes", "time_ms", "algbw_GBps", "busbw_GBps")
    rows = [
        (op, t["calls"], t["bytes"], t["time"] * 1e3, t["algbw"] / 1e9, t["busbw"] / 1e9) for op, t in by_op.items()
    ]
    return format_table(headers, rows)


def site_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per-call-site table (times in ms, bandwidths in GB/s)."""
    headers = ("caller", "op", "n", "calls", "bytes", "time_ms", "busbw_GBps")
    cells = [
        (r["caller"], r["op"], r["group_size"], r["calls"], r["bytes"], r["time"] * 1e3, r["busbw"] / 1e9) for r in rows
    ]
    return format_table(headers, cells)
