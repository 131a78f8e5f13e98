"""Large-batch training with LAMB and LARS on generated data (no downloads), on CPU.

Two tasks, each trained for the same number of epochs at a base batch and at 16x and 64x larger
batches (so 16x and 64x fewer steps), 10% linear warmup then cosine decay:

* an MLP with LayerNorm on a generated Gaussian-mixture classification task: AdamW against LAMB,
  both with square-root learning-rate scaling (the LAMB paper's rule, You et al., 2020) and the
  same parameter groups (no weight decay on biases and LayerNorm weights);
* a small conv net with BatchNorm on generated images (class templates, random shifts, noise):
  momentum SGD against LARS, both with linear learning-rate scaling (You et al., 2017).

Same tuning budget for every optimizer: a grid of base learning rates (``GRIDS``, factor-2 or
similar steps, the same number of values for the two optimizers of a task), each scaled by the
task's rule at every batch size. Two rows per optimizer: the base rate that is best at the base
batch, scaled (the papers' protocol: tune small, scale up), and the best of the grid at each batch
(re-tuned at every size). The grid itself is printed too.

    python packages/colossal-optim/examples/large_batch.py [--only AdamW,LAMB] [--epochs 6] [--train 32768]

About 5 minutes on one CPU thread (each pair 1.5-3 minutes; more on a loaded machine).
Prints the table of test accuracies in docs/packages/colossal-optim.md.
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


def train(model_fn, make_opt, data, batch: int, epochs: int, seed: int = 0) -> float:
    """Train for ``epochs`` at ``batch`` with 10% linear warmup then cosine decay; return test accuracy."""
    (x, y), (xt, yt) = data
    torch.manual_seed(seed)
    model = model_fn()
    opt = make_opt(model)
    steps = epochs * (len(x) // batch)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(len(x) // batch):
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
    "SGD": [0.01, 0.02, 0.05, 0.1],
    "LARS": [0.05, 0.1, 0.2, 0.5],
}


def factories():
    """name -> (model, data key, scaling rule k -> factor, optimizer factory(model, lr=...))."""
    sqrt, linear = (lambda k: math.sqrt(k)), (lambda k: float(k))
    return {
        "AdamW": (mlp, "mix", sqrt, lambda m, lr: torch.optim.AdamW(large_batch_param_groups(m, 0.01), lr=lr)),
        "LAMB": (mlp, "mix", sqrt, lambda m, lr: Lamb(large_batch_param_groups(m, 0.01), lr=lr)),
        "SGD": (convnet, "img", linear, lambda m, lr: torch.optim.SGD(
            m.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)),
        "LARS": (convnet, "img", linear, lambda m, lr: Lars(
            large_batch_param_groups(m, 5e-4), lr=lr, momentum=0.9, eta=0.02)),
    }  # fmt: skip


def sweep(name: str, data: dict, scales: list[int], base_batch: int, epochs: int) -> dict[tuple, float]:
    """Test accuracy for every (base lr of the grid, batch multiplier): lr = base * rule(k)."""
    model_fn, key, rule, make = factories()[name]
    return {
        (lr, k): train(model_fn, functools.partial(make, lr=lr * rule(k)), data[key], base_batch * k, epochs)
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
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--train", type=int, default=32768, help="training examples of the MLP task")
    parser.add_argument("--train-images", type=int, default=8192, help="training examples of the conv-net task")
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
    header = " | ".join(f"batch {args.base_batch * k} ({k}x)" for k in scales)
    print(f"| optimizer, learning rate | {header} |\n|---|{'---|' * len(scales)}", flush=True)
    for name in args.only.split(","):
        start = time.perf_counter()
        acc = sweep(name, data, scales, args.base_batch, args.epochs)
        report(name, acc, scales, time.perf_counter() - start)


if __name__ == "__main__":
    main()
