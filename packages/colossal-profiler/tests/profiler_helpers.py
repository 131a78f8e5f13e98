"""Helpers shared by the colossal-profiler tests: a manual clock, a fake event source, a tiny model."""

from __future__ import annotations

import dataclasses
import types

import torch

from colossal.profiler.records import ChunkMove, MemoryPoint


class ManualClock:
    """A clock that only moves when told to (``advance``), or by ``tick`` per read when set."""

    def __init__(self, start: float = 100.0, tick: float = 0.0) -> None:
        self.now, self.tick = start, tick

    def __call__(self) -> float:
        value = self.now
        self.now += self.tick
        return value

    def advance(self, seconds: float) -> None:
        self.now += seconds


def chunk_move_event(chunk_id, nbytes, src, dst, start, end, reason):
    """A chunk move as colossal.gemini publishes it (the profiler duck-types events on ``kind``)."""
    return types.SimpleNamespace(
        kind="chunk_move", **dataclasses.asdict(ChunkMove(chunk_id, nbytes, src, dst, start, end, reason))
    )


def memory_sample(time, tier, model_bytes, non_model_bytes, label):
    """A memory sample as colossal.gemini publishes it."""
    point = MemoryPoint(time, tier, model_bytes, non_model_bytes, label)
    return types.SimpleNamespace(
        kind="memory_sample",
        **{k: getattr(point, k) for k in ("time", "tier", "model_bytes", "non_model_bytes", "label")},
    )


class _Handle:
    def __init__(self, source: FakeSource, fn) -> None:
        self._source, self._fn = source, fn

    def remove(self) -> None:
        if self._fn in self._source.observers:
            self._source.observers.remove(self._fn)


class FakeSource:
    """An event source like colossal.comm / colossal.gemini: ``register_observer`` and ``emit``."""

    def __init__(self, name: str = "fake") -> None:
        self.__name__ = name
        self.observers: list = []

    def register_observer(self, fn) -> _Handle:
        self.observers.append(fn)
        return _Handle(self, fn)

    def emit(self, event) -> None:
        for fn in tuple(self.observers):
            fn(event)


class Advancing(torch.nn.Module):
    """Wraps a module; advances a manual clock by 1 s in its forward and by 1 s in its backward."""

    def __init__(self, inner: torch.nn.Module, clock: ManualClock) -> None:
        super().__init__()
        self.inner, self.clock = inner, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(1.0)
        y = self.inner(x)
        if y.requires_grad:
            y.register_hook(lambda grad: self.clock.advance(1.0))
        return y


def tiny_mlp(clock: ManualClock | None = None) -> torch.nn.Module:
    """Linear(8,16) -> [GELU, Linear(16,4)] -> Tanh; with a clock, each Linear is :class:`Advancing`."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    if clock is not None:
        first, last = Advancing(first, clock), Advancing(last, clock)
    return torch.nn.Sequential(first, torch.nn.Sequential(torch.nn.GELU(), last), torch.nn.Tanh())


def comm_event(op, ranks, nbytes, start, end, async_op=False):
    """A colossal.comm CommEvent with explicit times."""
    from colossal.comm import CommEvent

    return CommEvent(op=op, group_size=len(ranks), ranks=tuple(ranks), nbytes=nbytes, dtype=torch.float32,
                     async_op=async_op, start=start, end=end, tag=f"{op}-tag")  # fmt: skip


def scripted_step(out_dir=None, **options):
    """One profiled step on a manual clock with scripted collectives (times in the test docstrings).

    step [100, 108): forward [100, 102) (modules "0" [100, 101), "1" and "1.1" [101, 102)),
    blocking all_reduce on 4 ranks [102.5, 103.5) of 4000 B, backward [103.5, 105.5),
    async reduce_scatter on 2 ranks [104, 106.5) of 8000 B, optimizer [106, 107).
    """
    from colossal.profiler import Profiler

    clock, source = ManualClock(start=100.0), FakeSource("fake_comm")
    model = tiny_mlp(clock)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"discover": False, "memory": False, **options}
    with Profiler(model, opt, clock=clock, sources=[source], out_dir=out_dir, **options) as prof:
        opt.register_step_pre_hook(lambda *a: clock.advance(1.0))  # after ours: inside the span
        out = model(torch.randn(3, 8))  # forward [100, 102)
        clock.now = 103.5
        source.emit(comm_event("all_reduce", (0, 1, 2, 3), 4000, 102.5, 103.5))
        out.sum().backward()  # [103.5, 105.5)
        source.emit(comm_event("reduce_scatter", (0, 1), 8000, 104.0, 106.5, async_op=True))
        clock.now = 106.0
        opt.step()  # [106, 107)
        clock.now = 108.0
        prof.step()
    return prof, model, opt, source
