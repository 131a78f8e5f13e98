"""What the live progress shows: the memory field survives rich's markup, and bytes communicated
are kept apart from bytes moved between memory tiers."""

import dataclasses

from colossalai.cli.meters import Meters
from colossalai.cli.progress import TrainProgress


@dataclasses.dataclass
class _Move:  # the shape of colossal.gemini / colossal.zero ChunkMoveEvent
    src: str
    dst: str
    nbytes: int
    kind: str = "chunk_move"


@dataclasses.dataclass
class _Comm:  # the shape of colossal.comm CommEvent
    op: str
    nbytes: int


def _meters() -> Meters:
    meters = Meters()
    meters._on_event(_Move("cuda", "cpu", 3 * 1024))
    meters._on_event(_Move("cpu", "cuda", 1024))
    meters._on_event(_Comm("all_reduce", 2 * 1024))
    meters.moved["ddp"] += 1024
    return meters


def test_communication_and_tier_moves_are_counted_apart():
    meters = _meters()
    assert meters.communicated() == 3 * 1024
    assert meters.tier_moved() == 4 * 1024


def test_rich_bar_keeps_the_memory_field():
    meters = _meters()
    progress = TrainProgress(10, 0, mode="rich")
    try:
        progress.update(1, 2.5, meters)
        task = progress.bar.tasks[0]
        shown = progress.bar.columns[2].render(task).plain  # the status column
    finally:
        progress.close()
    assert "mem[cpu=" in shown and " cpu(peak)=" in shown, shown  # real RSS and its peak, next to the engine
    assert "comm 3.0 KiB" in shown and "tier-moves 4.0 KiB" in shown, shown
