"""colossal.profiler: in-iteration profiling of communication, memory and compute.

``with Profiler(model, optimizer, out_dir="prof") as prof: ... prof.step()`` records, per step,
every ``colossal.comm`` collective (when colossal-comm is installed), memory over time (model and
non-model data; Gemini/ZeRO tiers and chunk moves when they publish), forward/backward/optimizer
and module spans, and derives compute, communication, overlap, idle time, tokens/s and MFU.
It writes a Chrome/Perfetto trace per rank, TensorBoard scalars and tables, and a JSONL summary
that ``colossal-profiler summarize DIR`` prints. Depends on torch alone.
"""

from colossal.profiler.chrome import trace_events, write_trace
from colossal.profiler.cli import load_summaries, summarize
from colossal.profiler.comm import CommRecorder, caller_of, straggler_waits
from colossal.profiler.config import Action, ProfilerConfig, Schedule
from colossal.profiler.intervals import StepFigures, intersect, measure, step_figures, subtract, union
from colossal.profiler.memory import MemoryRecorder, device_allocated, model_bytes
from colossal.profiler.profiler import Profiler
from colossal.profiler.records import ChunkMove, CommRecord, MemoryPoint, Span, StepRecord
from colossal.profiler.summary import comm_by_op, comm_by_site, format_table
from colossal.profiler.tbevents import EventWriter, crc32c

__all__ = [
    "Action",
    "ChunkMove",
    "CommRecord",
    "CommRecorder",
    "EventWriter",
    "MemoryPoint",
    "MemoryRecorder",
    "Profiler",
    "ProfilerConfig",
    "Schedule",
    "Span",
    "StepFigures",
    "StepRecord",
    "caller_of",
    "comm_by_op",
    "comm_by_site",
    "crc32c",
    "device_allocated",
    "format_table",
    "intersect",
    "load_summaries",
    "measure",
    "model_bytes",
    "step_figures",
    "straggler_waits",
    "subtract",
    "summarize",
    "trace_events",
    "union",
    "write_trace",
]
