"""Large-batch training with LAMB and LARS on generated data (no downloads), on CPU.

Two tasks, each trained for the same number of epochs at a base batch and at 16x and 64x larger
batches (so 16x and 64x fewer steps):

* an MLP with LayerNorm on a generated Gaussian-mixture classification task (6 epochs, 10% linear
  warmup then cosine decay): AdamW against LAMB, both with square-root learning-rate scaling (the
  LAMB paper's rule, You et al., 2020) and the same parameter groups (no weight decay on biases
  and LayerNorm weights);
* a small conv net with BatchNorm on generated images (class templates, random shifts, noise;
  12 epochs, the LARS paper's schedule: linear warmup over 2 epochs then polynomial decay of power
  2): momentum SGD against LARS (eta 1e-3, large global rate, You et al., 2017), both with
  momentum 0.9, weight decay 5e-4, square-root scaling and the same parameter groups (biases and
  BatchNorm weights: no decay, and no trust ratio for LARS).

Same tuning budget for every optimizer: a grid of base learning rates (``GRIDS``, the same number
of values for the two optimizers of a task), each scaled by the task's rule at every batch size.
Two rows per optimizer: the base rate that is best at the base batch, scaled (the papers'
protocol: tune small, scale up), and the best of the grid at each batch (re-tuned at every size).
The grid itself is printed too.

    python packages/colossal-optim/examples/large_batch.py [--only SGD,LARS] [--epochs-images 12]

About 11 minutes on one CPU thread (MLP pair about 3, each conv-net optimizer about 4; more on
a loaded machine). Prints the table of test accuracies in docs/packages/colossal-optim.md.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch
from torch import nn

from colossal.optim import Lamb, Lars, large_batch_param_groups


def gaussian_mixture(n: int, gen: torch.Generator, classes: int = 10, dim: int = 32, modes: int = 8):
    """Each class is a mixture of ``modes`` overlapping Gaussians with fixed random centres; a sine warps the space."""
    centres = torch.randn(classes, modes, dim, generator=torch.Generator().manual_seed(0)) * 0.9
    y = torch.randint(classes, (n,), generator=gen)
    mode = torch.randint(modes, (n,), generator=gen)
    x = centres[y, mode] + torch.randn(n, dim, generator=gen)
    return x + 0.5 * torch.sin(2 * x), y


def template_images(n: int, gen: torch.Generator, classes: int = 10, size: int = 16):
    """Smoothed random class templates, randomly shifted by up to 3 pixels, plus noise: (n, 1, size, size)."""
    raw = torch.randn(classes, 1, size, size, generator=torch.Generator().manual_seed(1))
    templates = nn.functional.avg_pool2d(raw, 3, stride=1, padding=1) * 2
    y = torch.randint(classes, (n,), generator=gen)
    x = templates[y]
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    x = torch.stack([torch.roll(img, (int(a), int(b)), dims=(1, 2)) for img, (a, b) in zip(x, shifts)])
    return x + torch.randn(x.shape, generator=gen) * 1.0, y


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU(),
        nn.Linear(128, 10),
    )  # fmt: skip


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),  # (B, 16, 8, 8)
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),  # (B, 32, 4, 4)
        nn.Flatten(), nn.Linear(32 * 16, 10),
    )  # fmt: skip


def lr_factor(schedule: str, steps: int, per_epoch: int, warmup_epochs: float):
    """Step -> learning-rate factor: ``"cosine"`` (10% linear warmup, cosine decay; the MLP task) or
    ``"poly"`` (linear warmup over ``warmup_epochs``, then polynomial decay of power 2, as in the LARS paper)."""
    if schedule == "cosine":
        warm = max(1, steps // 10)
        return lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
    warm = max(1, round(warmup_epochs * per_epoch))
    return lambda s: (s + 1) / warm if s < warm else (1 - (s - warm) / (steps - warm)) ** 2


def train(model_fn, make_opt, data, batch: int, epochs: int, schedule: str, warmup_epochs: float, seed: int = 0):
    """Train for ``epochs`` at ``batch`` under ``schedule`` (see :func:`lr_factor`); return test accuracy."""
    (x, y), (xt, yt) = data
    torch.manual_seed(seed)
    model = model_fn()
    opt = make_opt(model)
    per_epoch = len(x) // batch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(schedule, epochs * per_epoch, per_epoch, warmup_epochs))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(per_epoch):
            idx = perm[i * batch : (i + 1) * batch]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        return (model(xt).argmax(-1) == yt).float().mean().item()


GRIDS = {  # base learning rates tried for every optimizer (same count): scaled per batch by the rule
    "AdamW": [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2],
    "LAMB": [2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2],
    "SGD": [0.0125, 0.025, 0.05],
    "LARS": [2.0, 4.0, 8.0],  # global rate; the layer's step is lr * eta * |w| / |g + wd w|
}


def factories():
    """name -> (model, data key, scaling rule k -> factor, optimizer factory(model, lr=...))."""
    sqrt = math.sqrt
    return {
        "AdamW": (mlp, "mix", sqrt, lambda m, lr: torch.optim.AdamW(large_batch_param_groups(m, 0.01), lr=lr)),
        "LAMB": (mlp, "mix", sqrt, lambda m, lr: Lamb(large_batch_param_groups(m, 0.01), lr=lr)),
        "SGD": (convnet, "img", sqrt, lambda m, lr: torch.optim.SGD(
            large_batch_param_groups(m, 5e-4), lr=lr, momentum=0.9)),
        "LARS": (convnet, "img", sqrt, lambda m, lr: Lars(
            large_batch_param_groups(m, 5e-4), lr=lr, momentum=0.9, eta=1e-3)),
    }  # fmt: skip


def sweep(name: str, data: dict, scales: list[int], base_batch: int, plan: dict) -> dict[tuple, float]:
    """Test accuracy for every (base lr of the grid, batch multiplier): lr = base * rule(k).

    ``plan[data key]`` is (epochs, schedule, warmup epochs) of that task, the same at every batch size."""
    model_fn, key, rule, make = factories()[name]
    return {
        (lr, k): train(model_fn, functools.partial(make, lr=lr * rule(k)), data[key], base_batch * k, *plan[key])
        for lr in GRIDS[name]
        for k in scales
    }


def report(name: str, acc: dict[tuple, float], scales: list[int], seconds: float) -> None:
    """Two table rows (tuned at the base batch then scaled; best of grid per batch) and the grid."""
    grid = GRIDS[name]
    best = max(grid, key=lambda lr: acc[(lr, scales[0])])
    cells = " | ".join(f"{acc[(best, k)]:.3f}" for k in scales)
    print(f"| {name}, base lr {best:g} (best at {scales[0]}x), scaled | {cells} |", flush=True)
    cells = " | ".join(f"{max(acc[(lr, k)] for lr in grid):.3f}" for k in scales)
    print(f"| {name}, best of grid at each batch | {cells} |  ({seconds:.0f} s)", flush=True)
    rows = "; ".join(f"{lr:g}: " + " ".join(f"{acc[(lr, k)]:.3f}" for k in scales) for lr in grid)
    print(f"  grid (base lr: accuracies) {rows}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6, help="epochs of the MLP task")
    parser.add_argument("--epochs-images", type=int, default=12, help="epochs of the conv-net task")
    parser.add_argument("--warmup-epochs", type=float, default=2.0, help="warmup of the conv-net task")
    parser.add_argument("--train", type=int, default=32768, help="training examples of the MLP task")
    parser.add_argument("--train-images", type=int, default=16384, help="training examples of the conv-net task")
    parser.add_argument("--base-batch", type=int, default=32)
    parser.add_argument("--scales", default="1,16,64", help="batch multipliers")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="AdamW,LAMB,SGD,LARS", help="optimizers to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen, gen_img = torch.Generator().manual_seed(123), torch.Generator().manual_seed(124)
    data = {"mix": (gaussian_mixture(args.train, gen), gaussian_mixture(4096, gen))}
    data["img"] = (template_images(args.train_images, gen_img), template_images(4096, gen_img))
    scales = [int(s) for s in args.scales.split(",")]
    plan = {"mix": (args.epochs, "cosine", 0.0), "img": (args.epochs_images, "poly", args.warmup_epochs)}
    header = " | ".join(f"batch {args.base_batch * k} ({k}x)" for k in scales)
    print(f"| optimizer, learning rate | {header} |\n|---|{'---|' * len(scales)}", flush=True)
    for name in args.only.split(","):
        start = time.perf_counter()
        acc = sweep(name, data, scales, args.base_batch, plan)
        report(name, acc, scales, time.perf_counter() - start)


if __name__ == "__main__":
    main()
