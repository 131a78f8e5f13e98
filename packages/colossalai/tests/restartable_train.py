"""A training script that torchrun may restart: it resumes from the latest run checkpoint.

Run by ``test_colossalai_restart.py`` as
``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 restartable_train.py ROOT OUT
--crash-at K`` (and without ``--crash-at`` for the uninterrupted reference). Everything that makes a
resume inexact is exercised: dropout and per-rank input noise (every rank's torch and Python RNG),
fp16 with an injected overflow (the loss scaler's state, a skipped step), a step LR schedule, and
data positions that fall mid-epoch and on an epoch boundary. At the end every rank writes its whole
state (model, optimizer, scheduler, scaler, RNG, data position, the loss of every step) to
``OUT/rank<r>.pt``; the test compares them bitwise.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colossal.comm import launch
from colossalai import Booster, RunState, TorchDDPPlugin
from colossalai.checkpoint import LATEST

PER_RANK_BATCH = 4
SAMPLES = 48  # 6 global steps of 8 per epoch at 2 ranks
OVERFLOW_STEPS = (4, 13)  # the loss is multiplied by inf here: the scaler backs off, the step is skipped


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=4, gamma=0.7)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 4, generator=gen)
    data = torch.utils.data.TensorDataset(x, y)
    return model, optim, sched, data


def train(root: pathlib.Path, out: pathlib.Path, steps: int, save_every: int, crash_at: int) -> None:
    launch(backend="gloo")
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16")
    model, optim, sched, data = build()
    loader = booster.prepare_dataloader(data, PER_RANK_BATCH, seed=0)
    model, optim, _, loader, sched = booster.boost(model, optim, None, loader, sched)
    torch.manual_seed(100 + rank)  # every rank draws different noise and dropout masks
    random.seed(100 + rank)
    state = RunState()
    if (root / LATEST).exists():
        state = booster.load_run(root, model, optim, sched, dataloader=loader)
    (out / f"attempt{attempt}-rank{rank}.txt").write_text(str(state.step))  # where this attempt started
    losses = torch.load(out / f"losses-rank{rank}.pt") if state.step else {}
    step, epoch, consumed = state.step, state.epoch, state.consumed_samples
    global_batch = PER_RANK_BATCH * dist.get_world_size()
    while step < steps:
        for x, y in loader:
            if step == crash_at and attempt == 0 and rank == 1:
                os._exit(17)  # a crash: no exception, no cleanup
            x = x + 0.01 * torch.randn_like(x)
            if random.random() < 0.5:
                x = -x
            loss = F.mse_loss(model(x).float(), y)
            if step in OVERFLOW_STEPS:
                loss = loss * float("inf")
            booster.backward(loss, optim)
            optim.step()
            optim.zero_grad()
            sched.step()
            losses[step] = loss.detach().clone()
            step, consumed = step + 1, consumed + global_batch
            if step % save_every == 0:
                booster.save_run(
                    root, model, optim, sched, state=RunState(step=step, epoch=epoch, consumed_samples=consumed)
                )
                torch.save(losses, out / f"losses-rank{rank}.pt")
            if step == steps:
                break
        else:  # the epoch ran out
            epoch, consumed = epoch + 1, 0
            loader.sampler.set_epoch(epoch)
    final = {
        "model": model.module.state_dict(),
        "optimizer": optim.unwrap().state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": optim.scaler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "data": (epoch, consumed, loader.sampler.epoch, loader.sampler.start_index),
        "losses": losses,
    }
    torch.save(final, out / f"rank{rank}.pt")
    # Teardown order matters: if DDP's reducer holds the last reference to the gloo process group
    # after destroy_process_group(), its destructor runs under the GIL while gloo's worker thread,
    # still freeing the last finished all-reduce, waits for the GIL: a deadlock inside torch (seen
    # once in a random-order run). Drop the DDP model while the group is registered, give the
    # worker threads a moment without the GIL, then destroy the group.
    dist.barrier()
    del final, model, optim, sched, loader, booster
    gc.collect()
    time.sleep(0.05)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=pathlib.Path, help="checkpoint root")
    parser.add_argument("out", type=pathlib.Path, help="folder for the final states")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=-1, help="rank 1 dies before this step of attempt 0")
    args = parser.parse_args()
    train(args.root, args.out, args.steps, args.save_every, args.crash_at)


if __name__ == "__main__":
    main()
