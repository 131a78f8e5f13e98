"""``colossal-profiler summarize DIR``: per-rank and merged tables from the JSONL summaries: figures,
phases, peak memory per tier, chunk moves, modules and communication."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from colossal.profiler.summary import comm_table, format_table, site_table

__all__ = ["main", "load_summaries", "summarize"]

_FIGURES = ("step_time", "compute", "comm", "exposed_comm", "overlap", "idle", "straggler_wait")


def load_summaries(directory: str) -> dict[int, list[dict[str, Any]]]:
    """Every ``summary.rank<r>.jsonl`` in ``directory``: rank -> its step lines."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in glob.glob(os.path.join(directory, "summary.rank*.jsonl")):
        match = re.search(r"summary\.rank(\d+)\.jsonl$", path)
        if match:
            with open(path, encoding="utf-8") as f:
                out[int(match.group(1))] = [json.loads(line) for line in f if line.strip()]
    return dict(sorted(out.items()))


def _mean(lines: list[dict[str, Any]], key: str, scale: float = 1.0) -> float | None:
    values = [line[key] for line in lines if line.get(key) is not None]
    return statistics.fmean(values) * scale if values else None


def _merge_ops(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in lines:
        for op, t in line["comm_by_op"].items():
            for key in ("calls", "bytes", "wire_bytes", "time"):
                merged[op][key] += t[key]
    for t in merged.values():
        t["algbw"] = t["bytes"] / t["time"] if t["time"] > 0 else 0.0
        t["busbw"] = t["wire_bytes"] / t["time"] if t["time"] > 0 else 0.0
        t["calls"], t["bytes"] = int(t["calls"]), int(t["bytes"])
    return dict(sorted(merged.items()))


def _merge_sites(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[tuple, dict[str, Any]] = {}
    for line in lines:
        for row in line["comm_by_site"]:
            key = (row["caller"], row["op"], row["group_size"])
            entry = merged.setdefault(key, {**row, "calls": 0, "bytes": 0, "wire_bytes": 0.0, "time": 0.0})
            for k in ("calls", "bytes", "wire_bytes", "time"):
                entry[k] += row[k]
    for entry in merged.values():
        entry["busbw"] = entry["wire_bytes"] / entry["time"] if entry["time"] > 0 else 0.0
    return sorted(merged.values(), key=lambda row: -row["time"])


def _phase_table(per_rank: dict[int, list[dict[str, Any]]]) -> str:
    names: list[str] = []
    for lines in per_rank.values():
        for line in lines:
            names += [n for n in line.get("phases", {}) if n not in names]
    rows = [
        (rank, *(statistics.fmean(line.get("phases", {}).get(n, 0.0) for line in lines) * 1e3 for n in names))
        for rank, lines in per_rank.items()
    ]
    return format_table(("rank", *(f"{n}_ms" for n in names)), rows)


def _memory_table(per_rank: dict[int, list[dict[str, Any]]]) -> str:
    rows = []
    for rank, lines in per_rank.items():
        peak: dict[str, int] = {}
        for line in lines:
            for tier, nbytes in line.get("peak_memory_by_tier", {}).items():
                peak[tier] = max(peak.get(tier, 0), nbytes)
        rows += [(rank, tier, nbytes / 2**20) for tier, nbytes in sorted(peak.items())]
    return format_table(("rank", "tier", "peak_MiB"), rows) if rows else "(no memory samples recorded)"


def _moves_table(every: list[dict[str, Any]]) -> str:
    merged: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for line in every:
        for row in line.get("chunk_moves", ()):
            entry = merged[(row["src"], row["dst"], row["reason"])]
            entry[0] += row["moves"]
            entry[1] += row["bytes"]
            entry[2] += row["time"]
    rows = [(f"{k[0]} -> {k[1]}", k[2] or "-", int(v[0]), v[1] / 1e6, v[2] * 1e3) for k, v in sorted(merged.items())]
    return format_table(("tiers", "reason", "moves", "MB", "time_ms"), rows) if rows else "(no chunk moves recorded)"


def _module_table(every: list[dict[str, Any]], top: int) -> str:
    steps = max(len(every), 1)
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0])
    for line in every:
        for name, t in line.get("modules", {}).items():
            entry = merged[name]
            entry[0] += t["time"]
            entry[1] += t["calls"]
            entry[3] += t.get("flops", 0)
        for name, t in line.get("modules_backward", {}).items():
            merged[name][2] += t["time"]
    ranked = sorted(merged.items(), key=lambda kv: -(kv[1][0] + kv[1][2]))[:top]
    rows = [
        (name, v[1] / steps, v[0] / steps * 1e3, v[2] / steps * 1e3 if v[2] else None, v[3] / steps / 1e9 or None)
        for name, v in ranked
    ]
    if not rows:
        return "(no modules recorded)"
    return format_table(("module", "calls", "forward_ms", "backward_ms", "GFLOP"), rows)


def summarize(directory: str, top: int = 20) -> str:
    """The text printed by ``summarize``: per-rank figures, phases and peak memory per tier, then
    chunk moves between tiers, the ``top`` modules by time and the communication tables, merged over
    ranks and recorded steps (per step for the modules)."""
    per_rank = load_summaries(directory)
    if not per_rank:
        raise FileNotFoundError(f"no summary.rank*.jsonl files in {directory!r}")
    headers = ("rank", "steps", *(f"{k}_ms" for k in _FIGURES), "comm_MB", "tokens_per_s", "mfu")
    rows = []
    for rank, lines in per_rank.items():
        times = [_mean(lines, k, 1e3) for k in _FIGURES]
        rows.append(
            (
                rank,
                len(lines),
                *times,
                _mean(lines, "comm_bytes", 1e-6),
                _mean(lines, "tokens_per_s"),
                _mean(lines, "mfu"),
            )
        )
    every = [line for lines in per_rank.values() for line in lines]
    slowest = max(per_rank, key=lambda r: _mean(per_rank[r], "step_time") or 0.0)
    recorded = sorted({line["step"] for line in every if "step" in line})
    parts = [
        "## Per rank (means over recorded steps)",
        format_table(headers, rows),
        f"\nslowest rank: {slowest}" + (f"; recorded steps: {', '.join(map(str, recorded))}" if recorded else ""),
        "\n## Phases (means over recorded steps)",
        _phase_table(per_rank),
        "\n## Peak memory by tier (max over recorded steps)",
        _memory_table(per_rank),
        "\n## Chunk moves between tiers (all ranks, all steps)",
        _moves_table(every),
        f"\n## Modules (all ranks, per step; top {top} by forward + backward time)",
        _module_table(every, top),
        "\n## Communication by op (all ranks, all steps)",
        comm_table(_merge_ops(every)),
        "\n## Communication by call site (all ranks, all steps)",
        site_table(_merge_sites(every)),
    ]
    return "\n".join(parts)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``colossal-profiler`` command."""
    parser = argparse.ArgumentParser(prog="colossal-profiler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    summ = sub.add_parser("summarize", help="print per-rank and merged tables of a profile folder")
    summ.add_argument("directory", help="the Profiler's out_dir")
    summ.add_argument("--top", type=_positive, default=20, help="modules shown, by time (default 20)")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.directory, args.top))
    except FileNotFoundError as err:
        print(f"colossal-profiler: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
