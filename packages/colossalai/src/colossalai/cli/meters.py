"""What the training progress shows besides the loss: throughput, memory per tier, and bytes
moved, kept apart by kind: communicated (collectives) and moved between memory tiers.

Bytes moved are collected from every source that publishes them: ``colossal.comm`` collectives
(``CommEvent``), chunk moves of ``colossal.zero`` / ``colossal.gemini`` (``ChunkMoveEvent``, by
tier pair), and DDP's gradient all-reduce (counted by a communication hook, since DDP talks to
torch.distributed directly). Memory per tier: the device allocator (CUDA), this process's
resident set (CPU), and the latest ``MemorySample`` of each tier an engine reports.
"""

from __future__ import annotations

import collections
import importlib
import time

import torch

from colossal.comm.memory import rss_and_peak_bytes

__all__ = ["Meters", "format_bytes"]


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Meters:
    """Collects throughput, memory and traffic figures for the progress display."""

    def __init__(self) -> None:
        self.moved: collections.Counter[str] = collections.Counter()
        """Bytes by channel: ``comm``, ``ddp``, ``cpu->cuda``, ..."""
        self.tier_bytes: dict[str, int] = {}
        """Latest engine-reported bytes per tier (model + non-model)."""
        self._handles: list = []
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        self.tokens = 0

    def attach(self) -> Meters:
        """Subscribe to every installed event source."""
        for module in ("colossal.comm", "colossal.zero", "colossal.gemini"):
            try:
                mod = importlib.import_module(module)
            except ImportError:
                continue
            if hasattr(mod, "register_observer"):
                self._handles.append(mod.register_observer(self._on_event))
        return self

    def detach(self) -> None:
        """Unsubscribe."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_event(self, event) -> None:
        kind = getattr(event, "kind", None)
        if kind == "chunk_move":
            self.moved[f"{event.src}->{event.dst}"] += event.nbytes
        elif kind == "memory_sample":
            self.tier_bytes[event.tier] = event.model_bytes + event.non_model_bytes
        elif hasattr(event, "op") and hasattr(event, "nbytes"):
            self.moved["comm"] += event.nbytes

    def count_ddp(self, model: torch.nn.Module) -> None:
        """Count DDP's gradient all-reduce bytes through a communication hook."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return

        def hook(state, bucket):
            buf = bucket.buffer()
            self.moved["ddp"] += buf.numel() * buf.element_size()
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)

    def memory(self) -> dict[str, int]:
        """Bytes per tier right now; ``cpu`` and ``cpu(peak)`` are the process's real resident memory and
        its peak so far, the ``(engine)`` entries what the engine accounts (the two side by side show
        what the allocator and temporaries add)."""
        rss, peak = rss_and_peak_bytes()  # one read of /proc/self/status (getrusage's peak without /proc)
        mem = {"cpu": rss if rss is not None else peak or 0, "cpu(peak)": peak or 0}
        if torch.cuda.is_available():
            mem["cuda"] = torch.cuda.memory_allocated()
        for tier, nbytes in self.tier_bytes.items():
            mem[f"{tier}(engine)"] = nbytes
        return mem

    def start(self) -> None:
        """(Re)start the throughput clock, e.g. after set-up."""
        self._t0, self._t1, self.tokens = time.perf_counter(), None, 0

    def stop(self) -> None:
        """Freeze the throughput clock (end of training; the final sample is not counted)."""
        self._t1 = time.perf_counter()

    def seconds(self) -> float:
        """Seconds between start and stop (or now)."""
        end = self._t1 if self._t1 is not None else time.perf_counter()
        return end - self._t0

    def tokens_per_s(self) -> float:
        """Tokens processed per second between start and stop (all ranks)."""
        end = self._t1 if self._t1 is not None else time.perf_counter()
        return self.tokens / max(end - self._t0, 1e-9)

    def communicated(self) -> int:
        """Bytes sent through collectives so far (``colossal.comm`` and DDP's all-reduce)."""
        return self.moved["comm"] + self.moved["ddp"]

    def tier_moved(self) -> int:
        """Bytes moved between memory tiers so far (chunk moves of Gemini / ZeRO offload)."""
        return sum(n for channel, n in self.moved.items() if "->" in channel)
