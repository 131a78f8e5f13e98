"""Evoformer trunk benchmark: inference unchunked vs chunked (vs chunked + in-place) vs DAP (with
and without communication/compute overlap), and a checkpointed training step with DAP=1 vs DAP=2
(overlapped and synchronous), in one run. Wall time and per-rank peak memory
(RSS high-water mark; see fastfold.inference [Note: how memory is measured]). The peer of every
ratio is the unchunked single-rank run of the same size, measured in the same run.

    python packages/fastfold/bench/bench_trunk.py                      # the issue's sizes
    python packages/fastfold/bench/bench_trunk.py --n-res 128 256 --chunk-size 32   # reduced
    python packages/fastfold/bench/bench_trunk.py --n-res 128 --dap-only   # DAP overlap on/off only
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from fastfold.inference import TrunkSpec, run_trunk
from fastfold.training import run_training

MiB = 2**20


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-seq", type=int, default=16)
    p.add_argument("--n-res", type=int, nargs="+", default=[256, 512])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--c-m", type=int, default=256)
    p.add_argument("--c-z", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--dap-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="total torch threads, split over ranks")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--train-n-res", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=1)
    p.add_argument("--dap-only", action="store_true", help="skip the chunked single-rank variants")
    return p.parse_args()


def _row(name, results, base=None):
    row = {
        "config": name,
        "seconds": max(r.seconds for r in results),
        "peak_rss_mib_per_rank": max(r.peak_rss_bytes for r in results) / MiB,
        "activation_mib_per_rank": max(r.activation_bytes for r in results) / MiB,
        "ranks": len(results),
    }
    if base is not None:
        row["time_vs_unchunked"] = row["seconds"] / base["seconds"]
        row["activation_vs_unchunked"] = row["activation_mib_per_rank"] / max(base["activation_mib_per_rank"], 1e-9)
        row["peak_vs_unchunked"] = row["peak_rss_mib_per_rank"] / base["peak_rss_mib_per_rank"]
    return row


def _inference(a, n_res):
    dap, c = a.dap_size, a.chunk_size
    variants = [] if a.dap_only else [("chunked", c, False, 1, False), ("chunked+inplace", c, True, 1, False)]
    variants += [
        (f"dap{dap}", None, False, dap, False),
        (f"dap{dap} no-overlap", None, False, dap, True),
        (f"dap{dap}+chunked+inplace", c, True, dap, False),
    ]
    common = dict(n_seq=a.n_seq, n_res=n_res, blocks=a.blocks, c_m=a.c_m, c_z=a.c_z, repeats=a.repeats)
    base = _row("unchunked", run_trunk(TrunkSpec(**common, threads=a.threads)))
    rows = [base]
    for name, chunk, inplace, d, sync in variants:
        threads = max(1, a.threads // d)
        spec = TrunkSpec(**common, chunk_size=chunk, inplace=inplace, dap_size=d, threads=threads, no_overlap=sync)
        rows.append(_row(name, run_trunk(spec), base))
    return rows


def _training(a):
    common = dict(n_seq=a.n_seq, n_res=a.train_n_res, blocks=a.blocks, c_m=a.c_m, c_z=a.c_z)
    base = _row("train dap1", run_training(TrunkSpec(**common, threads=a.threads), a.train_steps))
    rows = [base]
    for suffix, sync in (("", False), (" no-overlap", True)):
        spec = TrunkSpec(**common, dap_size=a.dap_size, threads=max(1, a.threads // a.dap_size), no_overlap=sync)
        rows.append(_row(f"train dap{a.dap_size}{suffix}", run_training(spec, a.train_steps), base))
    return rows


def _print(title, rows):
    print(f"\n{title}")
    print(f"{'config':<26}{'time s':>9}{'x base':>8}{'peak MiB/rank':>15}{'act MiB/rank':>14}{'act x base':>11}")
    for r in rows:
        print(
            f"{r['config']:<26}{r['seconds']:>9.2f}{r.get('time_vs_unchunked', 1.0):>8.2f}"
            f"{r['peak_rss_mib_per_rank']:>15.0f}{r['activation_mib_per_rank']:>14.0f}"
            f"{r.get('activation_vs_unchunked', 1.0):>11.3f}"
        )


def main():
    a = _args()
    # Worker threads sleep instead of spinning at barriers: on a shared host spinning OpenMP
    # threads distort the single-rank vs DAP comparison. Inherited by the rank processes.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    report = {"args": vars(a), "inference": {}, "training": []}
    for n_res in a.n_res:
        rows = _inference(a, n_res)
        report["inference"][str(n_res)] = rows
        _print(f"inference n_seq={a.n_seq} n_res={n_res} blocks={a.blocks} c_m={a.c_m} c_z={a.c_z}", rows)
    report["training"] = _training(a)
    _print(f"training step (checkpointed) n_res={a.train_n_res}", report["training"])
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fastfold_trunk.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {out / 'fastfold_trunk.json'}")


if __name__ == "__main__":
    main()
