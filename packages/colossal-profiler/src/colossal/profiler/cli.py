"""``colossal-profiler summarize DIR``: per-rank and merged tables from the JSONL summaries."""

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


def summarize(directory: str) -> str:
    """The text printed by ``summarize``: a per-rank figure table, then merged comm tables."""
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
    parts = [
        "## Per rank (means over recorded steps)",
        format_table(headers, rows),
        f"\nslowest rank: {slowest}",
        "\n## Communication by op (all ranks, all steps)",
        comm_table(_merge_ops(every)),
        "\n## Communication by call site (all ranks, all steps)",
        site_table(_merge_sites(every)),
    ]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``colossal-profiler`` command."""
    parser = argparse.ArgumentParser(prog="colossal-profiler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    summ = sub.add_parser("summarize", help="print per-rank and merged tables of a profile folder")
    summ.add_argument("directory", help="the Profiler's out_dir")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.directory))
    except FileNotFoundError as err:
        print(f"colossal-profiler: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
