"""Where does the soak's memory go? One process, repeated save/resume cycles, RSS after
``malloc_trim(0)`` and the Python heap (``tracemalloc``) after each cycle.

``--mode booster``: each cycle rebuilds the soak's setup (Booster with the DDP plugin, tiny GPT,
AdamW, scheduler, dataloader), loads the latest run, trains one step and saves a run (keeping two).
``--mode plain``: the same loop in plain torch (``nn.Sequential`` of 10 layers, AdamW,
``dcp.save`` / ``dcp.load`` of the state dicts), the reference. With ``--diff-every K`` the
allocation sites that grew most since the warm-up are printed every K cycles (a snapshot itself
costs tens of MiB of RSS, so the RSS figures after the first diff are not comparable).

    python packages/colossalai/bench/soak_memory_trace.py --mode booster --cycles 13 --diff-every 6
    python packages/colossalai/bench/soak_memory_trace.py --mode plain --cycles 60
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import pathlib
import shutil
import sys
import tempfile
import tracemalloc
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    return int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def booster_cycle(root: pathlib.Path, i: int) -> None:
    """Rebuild the soak setup, resume from ``root`` (after the first cycle), one step, save."""
    import soak_reliability

    from colossalai import RunState

    booster, model, optim, loader, sched = soak_reliability._setup("ddp")
    if i:
        booster.load_run(root, model, optim, sched, dataloader=loader)
    x, y = next(iter(loader))
    booster.backward(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()), optim)
    optim.step()
    optim.zero_grad()
    sched.step()
    booster.save_run(root, model, optim, sched, state=RunState(step=i + 1, epoch=0, consumed_samples=0))
    for old in sorted(root.glob("step-*"))[:-2]:
        shutil.rmtree(old)


def plain_cycle(root: pathlib.Path, i: int) -> None:
    """The same in plain torch: build, load the previous state with ``dcp.load``, step, ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), *layers, torch.nn.Linear(64, 256))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2 if i else 1):  # the first step materialises the optimizer state to load into
        model(torch.zeros(4, dtype=torch.long)).sum().backward()
        optim.step()
        optim.zero_grad()
        if i and _ == 0:
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            dcp.load(state, checkpoint_id=str(root / f"c{i - 1}"))
            model.load_state_dict(state["model"])
            optim.load_state_dict(state["optim"])
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(root / f"c{i}"))
    if i >= 2:
        shutil.rmtree(root / f"c{i - 2}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("booster", "plain"), default="booster")
    parser.add_argument("--cycles", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=6, help="cycle of the baseline snapshot")
    parser.add_argument("--diff-every", type=int, default=0, help="print the top growing sites every K cycles")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    libc = ctypes.CDLL("libc.so.6")
    cycle = booster_cycle if args.mode == "booster" else plain_cycle
    root = pathlib.Path(tempfile.mkdtemp(prefix="colossal-memtrace-"))
    tracemalloc.start(10)
    base, rss = None, []
    for i in range(args.cycles):
        cycle(root, i)
        gc.collect()
        libc.malloc_trim(0)
        rss.append(_rss())
        grew = (rss[-1] - rss[-2]) / 1024 if i else 0.0
        print(f"cycle {i}: RSS {rss[-1] / 2**20:.3f} MiB ({grew:+.1f} KiB), "
              f"Python heap {tracemalloc.get_traced_memory()[0] / 1024:.1f} KiB", flush=True)  # fmt: skip
        if i == args.warmup:
            base = tracemalloc.take_snapshot() if args.diff_every else None
        elif base is not None and (i - args.warmup) % args.diff_every == 0:
            print(f"sites that grew most over cycles {args.warmup} to {i}:")
            for stat in tracemalloc.take_snapshot().compare_to(base, "traceback")[:5]:
                print(f"  {stat.size_diff / 1024:+.1f} KiB ({stat.count_diff:+d} blocks) at {stat.traceback[-1]}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
