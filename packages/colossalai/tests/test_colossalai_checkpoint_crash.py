"""A process killed with SIGKILL while ``Booster.save_run`` writes over a good checkpoint leaves
that checkpoint loadable, with exactly the values it was saved with.

The parent trains one step and saves (the good checkpoint). A child process (this file run as a
script) trains two steps and saves again into the same root, under a new name or under the same
name, and pauses at a known point of the save, where the parent kills it with SIGKILL:

* ``writing``: DCP has written the data files of the partial directory, not its ``.metadata``;
* ``publishing``: just before the partial directory is renamed into place (under the same name the
  old directory has already been moved aside: ``[Note: atomic checkpoints]``);
* ``pointing``: the new directory is in place, ``latest`` not yet rewritten.

The pause is the child's own monkeypatch of ``FileSystemWriter.finish`` / ``os.replace``; nothing
in the library knows about the test. The parent then loads ``root`` (through ``latest``) into a
fresh model and optimizer and compares every tensor with the good checkpoint's, exactly.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from colossalai_harness import GLOBAL_BATCH, boosted_losses, boosted_setup

from colossalai import RunState
from colossalai.booster.registry import make_plugin
from colossalai.checkpoint import LATEST, read_latest

GOOD = "good"
WAIT_S = 240  # the child imports torch and trains two steps on a loaded 2-core machine


def _train_and_save(root: str, steps: int, name: str):
    booster, model, optim, loader = boosted_setup(make_plugin("ddp"))
    boosted_losses(booster, model, optim, loader, steps)
    booster.save_run(root, model, optim, state=RunState(step=steps, consumed_samples=steps * GLOBAL_BATCH), name=name)
    return model, optim


def _snapshot(model, optim) -> dict[str, torch.Tensor]:
    """Every model tensor and every tensor of the optimizer state, by name."""
    out = {f"model.{n}": t.detach().clone() for n, t in model.module.state_dict().items()}
    names = {id(p): n for n, p in model.module.named_parameters()}
    for p, entry in optim.unwrap().state.items():
        out.update({f"optim.{names[id(p)]}.{k}": v.detach().clone() for k, v in entry.items()})
    return out


def _pause_at(point: str, ready: pathlib.Path) -> None:
    """Make the coming save stop at ``point`` (module docstring) and tell the parent."""

    def pause(*args, **kwargs):
        ready.write_text(str(os.getpid()))
        time.sleep(WAIT_S)
        os._exit(3)  # never finish the save, even if nobody kills us

    if point == "writing":
        from torch.distributed.checkpoint import FileSystemWriter

        FileSystemWriter.finish = pause
        return
    marker, replace = (".partial" if point == "publishing" else f".{LATEST}.tmp"), os.replace

    def paused_replace(src, dst, *args, **kwargs):
        if str(src).endswith(marker):
            pause()
        return replace(src, dst, *args, **kwargs)

    os.replace = paused_replace


def _child(root: str, name: str, point: str, ready: str) -> None:
    booster, model, optim, loader = boosted_setup(make_plugin("ddp"))
    boosted_losses(booster, model, optim, loader, 2)  # different values from the good checkpoint
    _pause_at(point, pathlib.Path(ready))
    booster.save_run(root, model, optim, state=RunState(step=2, consumed_samples=2 * GLOBAL_BATCH), name=name)


def _crash_child(tmp_path: pathlib.Path, name: str, point: str) -> None:
    """Run the child until it reports the pause point, then SIGKILL it."""
    ready, log = tmp_path / "ready", (tmp_path / "child.log").open("w")
    cmd = [sys.executable, __file__, str(tmp_path / "ckpt"), name, point, str(ready)]
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + WAIT_S
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), f"the child never reached {point!r}:\n{(tmp_path / 'child.log').read_text()}"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        log.close()


CASES = [("new", "writing"), ("new", "pointing"), ("same", "writing"), ("same", "publishing")]


@pytest.mark.timeout(2 * WAIT_S + 60)
@pytest.mark.parametrize("name,point", CASES, ids=[f"{n}-name-{p}" for n, p in CASES])
def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path, name, point):
    root = tmp_path / "ckpt"
    saved = _snapshot(*_train_and_save(str(root), 1, GOOD))
    _crash_child(tmp_path, GOOD if name == "same" else "step-00000002", point)
    leftovers = {p.name for p in root.iterdir()}
    assert leftovers & {".good.partial", ".good.old", ".step-00000002.partial", "step-00000002"}, leftovers
    booster, model, optim, loader = boosted_setup(make_plugin("ddp"))
    state = booster.load_run(root, model, optim, dataloader=loader)
    assert state.step == 1 and read_latest(root).name.strip(".").startswith(GOOD)
    loaded = _snapshot(model, optim)
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    # The next save cleans up what the killed one left, and publishes normally.
    booster.save_run(root, model, optim, state=RunState(step=1, consumed_samples=GLOBAL_BATCH), name="next")
    assert not [p for p in root.iterdir() if p.name.endswith((".partial", ".old"))]
    assert read_latest(root).name == "next" and (root / GOOD).is_dir()


if __name__ == "__main__":
    _child(*sys.argv[1:5])
