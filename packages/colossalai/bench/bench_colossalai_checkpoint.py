"""Checkpoint cost: ``Booster.save_optimizer`` / ``load_optimizer`` (flat-slice pieces, entry table,
CRC-32 checksums verified on load, strict check) against plain ``torch.distributed.checkpoint``
(``dcp.save`` / ``dcp.load`` of the model and optimizer state dicts) measured in the same run.

Prints seconds and the ratio to plain DCP, and the CRC-32 throughput of this machine; writes JSON
to ``$COLOSSAL_BENCH_OUT`` (default ``./bench-results``). One process, DDP plugin.

    python packages/colossalai/bench/bench_colossalai_checkpoint.py --width 1024 --layers 16
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time
import warnings
import zlib

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_sd
from torch import nn

from colossalai import Booster
from colossalai.booster.registry import make_plugin


def _setup(width: int, layers: int):
    torch.manual_seed(0)
    booster = Booster(plugin=make_plugin("ddp"))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters())
    model, optim, *_ = booster.boost(model, optim)
    booster.backward(model(torch.randn(4, width)).sum(), optim)
    optim.step()
    return booster, model, optim


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _plain(model, optim, folder: str) -> tuple[float, float]:
    module = model.module
    state = {"model": dcp_sd.get_model_state_dict(module), "optim": dcp_sd.get_optimizer_state_dict(module, optim)}
    save = _timed(lambda: dcp.save(state, checkpoint_id=folder))
    return save, _timed(lambda: dcp.load(state, checkpoint_id=folder))


def _booster(booster, optim, folder: str) -> tuple[float, float]:
    save = _timed(lambda: booster.save_optimizer(optim, folder))
    return save, _timed(lambda: booster.load_optimizer(optim, f"{folder}/optimizer"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each (the best is reported)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    booster, model, optim = _setup(args.width, args.layers)
    results = {"plain-dcp": [], "booster": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            results["plain-dcp"].append(_plain(model, optim.unwrap(), f"{tmp}/plain{i}"))
            results["booster"].append(_booster(booster, optim, f"{tmp}/booster{i}"))
        size = sum(p.stat().st_size for p in pathlib.Path(tmp, "booster0").rglob("*") if p.is_file())
    blob = os.urandom(64 << 20)
    crc_mb_s = 64 / _timed(lambda: zlib.crc32(blob))
    best = {k: [min(v[0] for v in runs), min(v[1] for v in runs)] for k, runs in results.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters + AdamW state, {size / 1e6:.0f} MB; CRC-32 {crc_mb_s:.0f} MB/s")
    for name, (save, load) in best.items():
        ratio = f"  (x{save / best['plain-dcp'][0]:.2f} / x{load / best['plain-dcp'][1]:.2f} of plain DCP)"
        print(f"{name:10s} save {save:.2f} s  load {load:.2f} s" + (ratio if name != "plain-dcp" else ""))
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    record = {"params": params, "bytes": size, "crc32_mb_s": crc_mb_s, "seconds": best, "load_avg": os.getloadavg()}
    (out / "colossalai_checkpoint.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
