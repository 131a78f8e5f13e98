"""Chrome / Perfetto trace of recorded steps (``.json.gz``), one file per rank and cycle.

Layout (``pid`` = rank): one thread per track. Steps, phases, modules and blocking collectives are
complete (``X``) events, which nest on their track because the hooks open and close them in LIFO
order; asynchronous collectives and chunk moves can overlap each other, so they are async
(``b``/``e``) events with an id each; memory is a counter (``C``) per device or tier with the
model and non-model bytes stacked (the profiler's own sampler as ``memory <device>``, events from
Gemini/ZeRO as ``<source> memory <tier>``).
"""

from __future__ import annotations

import gzip
import json
from typing import Any

from colossal.profiler.records import CommRecord, StepRecord

__all__ = ["trace_events", "write_trace", "TRACKS"]

TRACKS = {"steps": 0, "phases": 1, "modules": 2, "modules_backward": 3, "comm": 4}
"""Thread id of each span track."""


def _us(t: float, origin: float) -> float:
    return (t - origin) * 1e6


def _meta(rank: int) -> list[dict[str, Any]]:
    events = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
    for track, tid in TRACKS.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return events


def _comm_args(c: CommRecord) -> dict[str, Any]:
    return {
        "group_size": c.group_size,
        "bytes": c.nbytes,
        "dtype": c.dtype,
        "algbw_GBps": c.algbw / 1e9,
        "busbw_GBps": c.busbw / 1e9,
        "caller": c.caller,
        "tag": c.tag,
        "wait_us": c.wait * 1e6,
    }


def _step_events(rec: StepRecord, rank: int, origin: float, next_id: list[int]) -> list[dict[str, Any]]:
    def complete(name: str, tid: int, start: float, end: float, args: dict) -> dict[str, Any]:
        ts = _us(start, origin)
        return {"ph": "X", "name": name, "pid": rank, "tid": tid, "ts": ts, "dur": _us(end, origin) - ts, "args": args}

    def async_pair(name: str, cat: str, start: float, end: float, args: dict) -> list[dict[str, Any]]:
        next_id[0] += 1
        base = {"name": name, "cat": cat, "pid": rank, "tid": TRACKS["comm"], "id": next_id[0]}
        return [
            {**base, "ph": "b", "ts": _us(start, origin), "args": args},
            {**base, "ph": "e", "ts": _us(end, origin)},
        ]

    out = [complete(f"step {rec.step}", TRACKS["steps"], rec.start, rec.end, {"step": rec.step})]
    out += [complete(s.name, TRACKS[s.track], s.start, s.end, s.args) for s in rec.spans]
    for c in rec.comm:
        if c.async_op:
            out += async_pair(c.op, "comm_async", c.start, c.end, _comm_args(c))
        else:
            out.append(complete(c.op, TRACKS["comm"], c.start, c.end, _comm_args(c)))
    for m in rec.moves:
        args = {"chunk": m.chunk_id, "bytes": m.nbytes, "src": m.src, "dst": m.dst, "reason": m.reason}
        out += async_pair(f"chunk {m.src}->{m.dst}", "chunk_move", m.start, m.end, args)
    for p in rec.memory:
        counter_args = {"model": p.model_bytes, "non_model": p.non_model_bytes}
        name = f"memory {p.tier}" if p.source == "sampler" else f"{p.source} memory {p.tier}"
        out.append({"ph": "C", "name": name, "pid": rank, "ts": _us(p.time, origin), "args": counter_args})
    return out


def trace_events(steps: list[StepRecord], rank: int, origin: float) -> list[dict[str, Any]]:
    """All trace events of ``steps`` (metadata first; timestamps in µs since ``origin``)."""
    events, next_id = _meta(rank), [0]
    for rec in steps:
        events += _step_events(rec, rank, origin, next_id)
    return events


def write_trace(path: str, steps: list[StepRecord], rank: int, origin: float) -> None:
    """Write the trace of ``steps`` as gzipped Chrome JSON to ``path``."""
    doc = {"traceEvents": trace_events(steps, rank, origin), "displayTimeUnit": "ms"}
    data = json.dumps(doc, separators=(",", ":")).encode()  # one string: json.dump streams tiny writes
    with gzip.open(path, "wb", compresslevel=4) as f:
        f.write(data)
