"""Large-batch training with LAMB and LARS on generated data (no downloads), on CPU in minutes.

Two tasks, each trained for the same number of epochs at a base batch and at 16x and 64x larger
batches (so 16x and 64x fewer steps), with the papers' learning-rate scaling and a linear warmup:

* an MLP with LayerNorm on a generated Gaussian-mixture classification task: Adam against LAMB,
  both with square-root learning-rate scaling (You et al., 2020);
* a small conv net with BatchNorm on generated images (class templates, random shifts, noise):
  momentum SGD against LARS, both with linear learning-rate scaling (You et al., 2017).

    python packages/colossal-optim/examples/large_batch.py [--epochs 6] [--threads 2]

Prints a table of test accuracies (the table in docs/packages/colossal-optim.md comes from it).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--train", type=int, default=8192, help="training examples per task")
    parser.add_argument("--base-batch", type=int, default=32)
    parser.add_argument("--scales", default="1,16,64", help="batch multipliers")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(123)
    mix = (gaussian_mixture(args.train, gen), gaussian_mixture(4096, gen))
    imgs = (template_images(args.train, gen), template_images(4096, gen))
    runs = {
        "MLP / Adam (sqrt lr scaling)": (mlp, mix, lambda m, k: torch.optim.AdamW(
            m.parameters(), lr=3e-3 * math.sqrt(k), weight_decay=0.01)),
        "MLP / LAMB (sqrt lr scaling)": (mlp, mix, lambda m, k: Lamb(
            large_batch_param_groups(m, 0.01), lr=2e-2 * math.sqrt(k))),
        "ConvNet / SGD (linear lr scaling)": (convnet, imgs, lambda m, k: torch.optim.SGD(
            m.parameters(), lr=0.02 * k, momentum=0.9, weight_decay=5e-4)),
        "ConvNet / LARS (linear lr scaling)": (convnet, imgs, lambda m, k: Lars(
            large_batch_param_groups(m, 5e-4), lr=0.1 * k, momentum=0.9, eta=0.02)),
    }  # fmt: skip
    scales = [int(s) for s in args.scales.split(",")]
    header = " | ".join(f"batch {args.base_batch * k} ({k}x)" for k in scales)
    print(f"| run | {header} |\n|---|{'---|' * len(scales)}", flush=True)
    for name, (model_fn, data, opt_fn) in runs.items():
        start = time.perf_counter()
        accs = [train(model_fn, functools.partial(opt_fn, k=k), data, args.base_batch * k, args.epochs) for k in scales]
        cells = " | ".join(f"{a:.3f}" for a in accs)
        print(f"| {name} | {cells} |  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
