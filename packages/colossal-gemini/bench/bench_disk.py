# ruff: noqa: E501
"""A GPT whose model states exceed this machine's RAM, trained with Gemini's disk tier (not CI).

Model states = fp32 parameters + fp32 gradients + Adam's two fp32 moments = 16 bytes per parameter.
The model is built on the meta device and materialised chunk by chunk straight into the tiers
(``param_init_fn``), so no full copy ever exists in RAM. Prints, per step: loss, step time, disk
bytes read/written, I/O wait; then model-state bytes / physical RAM, peak RSS (VmHWM) / RAM, and the
disk throughput of the optimizer step next to a raw sequential ``O_DIRECT`` read and write floor
measured in the same run, on the same directory (efficiency = the time the raw floor needs for the
step's bytes / the step's time).

Validate small first, then run the big one once::

    python packages/colossal-gemini/bench/bench_disk.py --params 0.3e9 --dir /work/scratch --steps 2
    nohup python packages/colossal-gemini/bench/bench_disk.py --params 2.05e9 --dir /work/scratch \\
        > bench_disk.log 2>&1 &

Every step trains on the same random batch, so the loss falls by memorisation: it shows that the
update is applied through the disk round trip (not a claim about generalisation).

DeepSpeed ZeRO-Infinity (the NVMe offload it is compared with in the issue) is not run here: see
the package README for what failed.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import shutil
import time

import torch

from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.optim import CPUAdam
from colossal.testkit import GPT, GPTConfig, lm_loss

GIB = 1 << 30


def mem_total() -> int:
    """Physical RAM in bytes (MemTotal)."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def vm_hwm() -> int:
    """Peak resident set size of this process in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def shape_for(params: float, vocab: int) -> tuple[int, int]:
    """(n_layer, n_embd) of a GPT with about ``params`` parameters (12 L d^2 + vocab d), d/L near 100."""
    best = None
    for layers in range(2, 97):
        d = math.sqrt(params / (12 * layers))
        d = max(128, round(d / 128) * 128)
        n = 12 * layers * d * d + vocab * d
        score = abs(math.log(n / params)) + 0.05 * abs(math.log(d / (100 * layers)))
        if best is None or score < best[0]:
            best = (score, layers, d)
    return best[1], best[2]


def raw_floor(directory: str, nbytes: int, block: int = 64 << 20) -> tuple[float, float]:
    """Sequential O_DIRECT write then read of ``nbytes`` in ``block``-byte requests: (write, read) B/s."""
    path = os.path.join(directory, f"colossal-floor-{os.getpid()}.bin")
    buf = mmap.mmap(-1, block)  # page aligned
    buf.write(os.urandom(1 << 20) * (block >> 20))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        os.unlink(path)
        t = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        w = nbytes / (time.perf_counter() - t)
        t = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [buf], off)
        r = nbytes / (time.perf_counter() - t)
    finally:
        os.close(fd)
    return w, r


def init_fn(name: str, t: torch.Tensor) -> None:
    """GPT-2 style initialisation of one parameter (filled in place, chunk by chunk)."""
    with torch.no_grad():
        if t.dim() >= 2:
            t.normal_(0.0, 0.02)
        elif name.endswith("weight"):  # layer norm scale
            t.fill_(1.0)
        else:
            t.zero_()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2.05e9, help="parameters of the GPT (about)")
    ap.add_argument("--dir", required=True, help="directory of the disk tier (and the floor measurement)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--device-gib", type=float, default=2.5, help="accounted device budget (CPU: part of RAM)")
    ap.add_argument("--host-gib", type=float, default=4.0, help="host_memory_budget")
    ap.add_argument("--floor-gib", type=float, default=4.0, help="bytes of the raw O_DIRECT floor measurement")
    ap.add_argument("--chunk-mib", type=float, default=0, help="chunk size in MiB of fp32 (0: searched)")
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ram = mem_total()
    os.makedirs(args.dir, exist_ok=True)
    free0 = shutil.disk_usage(args.dir).free
    print(f"machine: RAM {ram / GIB:.1f} GiB, {os.cpu_count()} cores, load {os.getloadavg()}, free on {args.dir} "
          f"{free0 / 1e9:.1f} GB, torch threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    fw, fr = raw_floor(args.dir, int(args.floor_gib * GIB))
    print(f"raw O_DIRECT floor: write {fw / 1e9:.2f} GB/s, read {fr / 1e9:.2f} GB/s", flush=True)

    layers, width = shape_for(args.params, args.vocab)
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_embd=width, n_layer=layers, n_head=max(1, width // 128)
    )
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    states = 16 * n_params
    print(f"GPT: {layers} layers x {width}, vocab {args.vocab}, seq {args.seq}: {n_params / 1e9:.3f}B parameters, "
          f"model states {states / GIB:.1f} GiB = {states / ram:.2f}x RAM", flush=True)  # fmt: skip

    t0 = time.perf_counter()
    chunk = int(args.chunk_mib * (1 << 20) / 4) or None
    gem = GeminiDDP(
        model,
        placement="auto",
        device_memory_budget=int(args.device_gib * GIB),
        host_memory_budget=int(args.host_gib * GIB),
        disk_dir=args.dir,
        param_init_fn=init_fn,
        chunk_size=chunk,
        disk_io_threads=args.io_threads,
    )
    opt = GeminiOptimizer(
        CPUAdam(gem.parameters(), lr=args.lr, flatten=False), gem, check_overflow=False, max_grad_norm=None
    )
    m = gem.manager
    disk = m.disk
    print(f"setup {time.perf_counter() - t0:.1f} s: {len(m.chunks)} chunks of {m.chunk_size} elements, disk file "
          f"{disk.size / 1e9:.1f} GB (O_DIRECT {disk.direct}), blocks on disk {sum(bool(c.on_disk) for c in m.chunks)}, "
          f"RSS peak {vm_hwm() / GIB:.2f} GiB", flush=True)  # fmt: skip

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    rows = []
    for step in range(args.steps):
        t = time.perf_counter()
        loss = lm_loss(gem(x), y)
        opt.backward(loss)
        r0, w0, _ = disk.counters()
        ts = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        r1, w1, _ = disk.counters()
        s = gem.stats
        opt_s = t1 - ts
        floor_s = (r1 - r0) / fr + (w1 - w0) / fw
        row = dict(
            step=step,
            loss=loss.item(),
            step_s=t1 - t,
            fwd_bwd_s=ts - t,
            optim_s=opt_s,
            disk_read_gb=s.disk_bytes_read / 1e9,
            disk_written_gb=s.disk_bytes_written / 1e9,
            io_wait_s=s.disk_wait_seconds,
            optim_disk_gbps=((r1 - r0) + (w1 - w0)) / opt_s / 1e9,
            optim_floor_frac=floor_s / opt_s,
            belady_disk_gb=(s.belady_disk_bytes or 0) / 1e9,
            rss_peak_gib=vm_hwm() / GIB,
        )
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

    hwm = vm_hwm()
    last = rows[-1]
    print("\n| quantity | value |\n|---|---|")
    table = [
        ("parameters", f"{n_params / 1e9:.3f} B ({layers} layers x {width}, vocab {args.vocab}, seq {args.seq})"),
        ("model states (16 B/param) / physical RAM", f"{states / GIB:.1f} GiB / {ram / GIB:.1f} GiB = {states / ram:.2f}x"),
        ("peak RSS (VmHWM) / RAM", f"{hwm / GIB:.2f} GiB = {hwm / ram:.2f}x"),
        ("budgets", f"device {args.device_gib} GiB (accounted, CPU), host {args.host_gib} GiB"),
        ("loss by step", " -> ".join(f"{r['loss']:.3f}" for r in rows)),
        ("step time (last)", f"{last['step_s']:.1f} s (forward+backward {last['fwd_bwd_s']:.1f} s, optimizer {last['optim_s']:.1f} s)"),
        ("disk bytes per step (last)", f"read {last['disk_read_gb']:.1f} GB, written {last['disk_written_gb']:.1f} GB "
         f"(two-level optimum for the same plan {last['belady_disk_gb']:.1f} GB)"),
        ("I/O wait (last step)", f"{last['io_wait_s']:.1f} s"),
        ("raw O_DIRECT floor", f"write {fw / 1e9:.2f} GB/s, read {fr / 1e9:.2f} GB/s"),
        ("optimizer-step disk throughput", f"{last['optim_disk_gbps']:.2f} GB/s = {last['optim_floor_frac'] * 100:.0f}% of the floor"),
    ]  # fmt: skip
    for k, v in table:
        print(f"| {k} | {v} |")
    disk.close()
    print(f"\nfree on {args.dir} after: {shutil.disk_usage(args.dir).free / 1e9:.1f} GB", flush=True)


if __name__ == "__main__":
    main()
