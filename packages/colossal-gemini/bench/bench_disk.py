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

Side by side with DeepSpeed ZeRO-Infinity (``--peer zero-infinity``): the script measures the raw
floor once, then trains the same model (same shape, sequence, batch, fp32, initialisation law, Adam
hyper-parameters, torch threads) in a fresh process per row: ``ours`` (the disk tier as above) and
``zero-infinity`` (DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on ``nvme`` under
``--dir``, its async I/O op on ``libaio``, ``DeepSpeedCPUAdam``, the model built under
``deepspeed.zero.Init(remote_device="nvme")`` so no full copy exists in RAM either). Every row reports
s/step, peak RSS (VmHWM), the bytes the process really read from and wrote to the block device per
step (``/proc/self/io``, the same meter for both rows) and the loss by step; the table ends with the
throughput ratio ours / ZeRO-Infinity (their s/step over ours, after the warm-up step)::

    /work/venv-ds/bin/python packages/colossal-gemini/bench/bench_disk.py --params 0.5e9 \\
        --dir /work/scratch --steps 3 --peer zero-infinity

The allocator trade-off (``--peer glibc-heap``): the same ``ours`` row twice, the second with
``MALLOC_MMAP_THRESHOLD_=33554432`` in its environment, which Gemini leaves alone (``[Note: the
allocator's peak]`` in ``colossal.gemini.host_memory``): glibc then serves chunk-sized buffers from
its heap, the faster step and the larger peak RSS. The table's throughput line is the ratio::

    python packages/colossal-gemini/bench/bench_disk.py --params 8e6 --dir /tmp/scratch --steps 4 \
        --seq 64 --device-gib 0.012 --host-gib 0.02 --floor-gib 0.25 --peer glibc-heap

The DeepSpeed row needs ``deepspeed`` (``bench/requirements.txt``) and ``libaio-dev``; it runs on the
CPU accelerator (``DS_ACCELERATOR=cpu`` is set for it unless CUDA is present) with a one-rank
``gloo`` group. Its NVMe settings are the documented ones scaled to the model so that parameters
really stream from disk (``max_in_cpu`` 1, eight parameter buffers of the largest parameter,
``sub_group_size`` = max(2e7, largest parameter)); ``--ds-*`` options change them.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import shutil
import subprocess
import sys
import threading
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


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has caused the block layer to fetch/send (/proc/self/io)."""
    vals = {}
    for line in open("/proc/self/io"):
        k, v = line.split(":")
        vals[k] = int(v)
    return vals["read_bytes"], vals["write_bytes"]


def model_config(args: argparse.Namespace, init: str = "gpt2") -> tuple[GPTConfig, int, int]:
    """The benchmark GPT's config for ``--params`` (the same for every row)."""
    layers, width = shape_for(args.params, args.vocab)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_embd=width,
        n_layer=layers,
        n_head=max(1, width // 128),
        init=init,
    )
    return cfg, layers, width


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The one fixed random batch every row trains on."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    return x, y


def run_ours(args: argparse.Namespace, fw: float, fr: float) -> dict:
    """Train with Gemini's disk tier; per-step rows and a summary dict."""
    torch.manual_seed(0)  # init_fn draws from the global generator: every row starts from the same weights
    ram = mem_total()
    cfg, layers, width = model_config(args)
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    states = 16 * n_params
    print(f"GPT: {layers} layers x {width}, vocab {args.vocab}, seq {args.seq}: {n_params / 1e9:.3f}B parameters, "
          f"model states {states / GIB:.1f} GiB = {states / ram:.2f}x RAM", flush=True)  # fmt: skip

    t0 = time.perf_counter()
    hwm_before = vm_hwm()  # the process (torch, the meta model) before Gemini exists
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
        disk_prefetch=args.disk_prefetch,
    )
    opt = GeminiOptimizer(
        CPUAdam(gem.parameters(), lr=args.lr, flatten=False), gem, check_overflow=False, max_grad_norm=None
    )
    m = gem.manager
    disk = m.disk
    setup_s = time.perf_counter() - t0
    print(f"setup {setup_s:.1f} s: {len(m.chunks)} chunks of {m.chunk_size} elements, disk file "
          f"{disk.size / 1e9:.1f} GB (O_DIRECT {disk.direct}), blocks on disk {sum(bool(c.on_disk) for c in m.chunks)}, "
          f"RSS peak {vm_hwm() / GIB:.2f} GiB", flush=True)  # fmt: skip

    x, y = batch(args)
    rows = []
    for step in range(args.steps):
        io0 = proc_io()
        c0 = time.process_time()
        t = time.perf_counter()
        wait0 = disk.counters()[2]
        loss = lm_loss(gem(x), y)
        opt.backward(loss)
        r0, w0, wait1 = disk.counters()
        ts = time.perf_counter()
        cs = time.process_time()
        opt.step()
        t1 = time.perf_counter()
        r1, w1, wait2 = disk.counters()
        io1 = proc_io()
        s = gem.stats
        opt_s = t1 - ts
        floor_s = (r1 - r0) / fr + (w1 - w0) / fw
        row = dict(
            step=step,
            loss=loss.item(),
            step_s=t1 - t,
            cpu_s=time.process_time() - c0,
            fwd_bwd_s=ts - t,
            optim_s=opt_s,
            optim_cpu_s=time.process_time() - cs,
            io_wait_fwd_bwd_s=wait1 - wait0,
            io_wait_optim_s=wait2 - wait1,
            disk_read_gb=s.disk_bytes_read / 1e9,
            disk_written_gb=s.disk_bytes_written / 1e9,
            io_read_gb=(io1[0] - io0[0]) / 1e9,
            io_written_gb=(io1[1] - io0[1]) / 1e9,
            io_wait_s=s.disk_wait_seconds,
            optim_disk_gbps=((r1 - r0) + (w1 - w0)) / opt_s / 1e9,
            optim_floor_frac=floor_s / opt_s,
            belady_disk_gb=(s.belady_disk_bytes or 0) / 1e9,
            rss_peak_gib=vm_hwm() / GIB,
        )
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    disk_size = disk.size
    disk.close()
    return dict(
        row=args.row or "ours",
        n_params=n_params,
        hwm_before=hwm_before,
        layers=layers,
        width=width,
        setup_s=setup_s,
        rows=rows,
        hwm=vm_hwm(),
        disk_file_gb=disk_size / 1e9,
        detail=f"{len(m.chunks)} chunks of {m.chunk_size / 1e6:.1f} M elements, device {args.device_gib} GiB "
        f"(accounted), host {args.host_gib} GiB",
    )


DS_PERSISTENCE = 100_000  # DeepSpeed's default stage3_param_persistence_threshold: smaller parameters stay in RAM


def zero_infinity_config(args: argparse.Namespace, sizes: list[int], nvme: str) -> dict:
    """DeepSpeed ZeRO-3 config with parameters and optimizer states on NVMe (fp32, one rank, batch 1).

    ``sizes``: the numel of every parameter. Every swapped parameter (above the persistence threshold)
    that is live or being prefetched holds one whole swap buffer, so the buffer count is raised to the
    most swapped parameters that fit in ``max_live + prefetch`` (plus two), and ``max_reuse_distance``
    is set to ``max_live``: with its default (1e9) DeepSpeed keeps every parameter it will use again
    available after the traced first step and fails in the second one with "Not enough buffers 0 for
    swapping 1".
    """
    largest = max(sizes)
    buf = max(int(args.ds_buffer_size), largest)
    live = max(int(args.ds_max_live), 2 * largest)
    prefetch = max(int(args.ds_prefetch), largest)
    fit, total = 0, 0
    for n in sorted(n for n in sizes if n > DS_PERSISTENCE):
        total += n
        if total > live + prefetch:
            break
        fit += 1
    buffers = max(args.ds_buffers, fit + 3)
    return {
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": True,
            "overlap_comm": False,
            "sub_group_size": max(int(args.ds_sub_group), largest),
            "stage3_max_live_parameters": live,
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_max_reuse_distance": live,
            "stage3_param_persistence_threshold": DS_PERSISTENCE,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": False,
                "buffer_count": buffers,
                "buffer_size": buf,
                "max_in_cpu": 1,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": False,
                "buffer_count": 4,
                "pipeline_read": False,
                "pipeline_write": False,
            },
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "thread_count": args.io_threads,  # as many I/O threads as ours
            "single_submit": False,
            "overlap_events": True,
        },
    }


def use_prebuilt_ops() -> None:
    """Load DeepSpeed's JIT ops from ``TORCH_EXTENSIONS_DIR`` when they are already built there.

    ``torch.utils.cpp_extension.load`` always runs ninja, and ninja recompiles every object whose
    command it finds no record of (a missing or truncated ``.ninja_log``): on 2 loaded cores that is
    half an hour for ``async_io`` alone. A built ``<dir>/<name>/<name>.so`` is imported as is.
    """
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return
    build = cpp_extension.load

    def load(name: str, *a, **kw):
        so = os.path.join(root, name, f"{name}.so")
        if os.path.exists(so):
            print(f"deepspeed op {name}: prebuilt {so}", flush=True)
            return cpp_extension._import_module_from_library(name, os.path.dirname(so), True)
        return build(name, *a, **kw)

    cpp_extension.load = load


def run_zero_infinity(args: argparse.Namespace) -> dict:
    """Train the same GPT with DeepSpeed ZeRO-Infinity (ZeRO-3, params + optimizer on NVMe)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                 ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # fmt: skip
        os.environ.setdefault(k, v)
    use_prebuilt_ops()
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(args.threads)  # deepspeed's import may have changed it
    # One rank: DeepSpeed's shared-memory all-reduce op is never used, so do not JIT-build it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ram = mem_total()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    cfg, layers, width = model_config(args, init="torch")
    with torch.device("meta"):
        shapes = GPT(cfg)
    n_params = sum(p.numel() for p in shapes.parameters())
    sizes = [p.numel() for p in shapes.parameters()]
    largest = max(sizes)
    del shapes
    states = 16 * n_params
    print(f"GPT: {layers} layers x {width}, vocab {args.vocab}, seq {args.seq}: {n_params / 1e9:.3f}B parameters, "
          f"model states {states / GIB:.1f} GiB = {states / ram:.2f}x RAM; largest parameter {largest / 1e6:.1f} M",
          flush=True)  # fmt: skip
    nvme = os.path.join(args.dir, "zero-infinity")
    os.makedirs(nvme, exist_ok=True)
    ds_cfg = zero_infinity_config(args, sizes, nvme)
    print("deepspeed config:", json.dumps(ds_cfg["zero_optimization"]), flush=True)

    # The same initialisation law as ``init_fn`` (N(0, 0.02) matrices, unit LayerNorm scales, zero
    # biases), applied by each module's own reset_parameters before zero.Init partitions it.
    def linear_reset(self: torch.nn.Linear) -> None:
        torch.nn.init.normal_(self.weight, 0.0, 0.02)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def embedding_reset(self: torch.nn.Embedding) -> None:
        torch.nn.init.normal_(self.weight, 0.0, 0.02)

    torch.nn.Linear.reset_parameters = linear_reset  # this process only runs this row
    torch.nn.Embedding.reset_parameters = embedding_reset

    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg, remote_device="nvme", pin_memory=False):
        model = GPT(cfg)
    opt = DeepSpeedCPUAdam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                           adamw_mode=True)  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    setup_s = time.perf_counter() - t0
    print(f"setup {setup_s:.1f} s, RSS peak {vm_hwm() / GIB:.2f} GiB", flush=True)

    x, y = batch(args)
    rows = []
    for step in range(args.steps):
        io0 = proc_io()
        c0 = time.process_time()
        t = time.perf_counter()
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        ts = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        io1 = proc_io()
        row = dict(
            step=step,
            loss=loss.item(),
            step_s=t1 - t,
            cpu_s=time.process_time() - c0,
            fwd_bwd_s=ts - t,
            optim_s=t1 - ts,
            io_read_gb=(io1[0] - io0[0]) / 1e9,
            io_written_gb=(io1[1] - io0[1]) / 1e9,
            rss_peak_gib=vm_hwm() / GIB,
        )
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    disk_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)
    return dict(
        row="zero-infinity",
        n_params=n_params,
        layers=layers,
        width=width,
        setup_s=setup_s,
        rows=rows,
        hwm=vm_hwm(),
        disk_file_gb=disk_bytes / 1e9,
        detail=f"deepspeed {deepspeed.__version__}, sub_group {ds_cfg['zero_optimization']['sub_group_size']:.3g}, "
        f"{ds_cfg['zero_optimization']['offload_param']['buffer_count']} param buffers of {ds_cfg['zero_optimization']['offload_param'].get('buffer_size', 0):.3g}",
    )


def steady(rows: list[dict]) -> list[dict]:
    """The steps after the warm-up step (all of them if there is only one)."""
    return rows[1:] or rows


def _watch_rss(proc: subprocess.Popen, limit: float) -> list[int]:
    """Kill ``proc`` when its resident set exceeds ``limit`` bytes (so a row that needs more memory than the
    machine has fails with a figure instead of waking the kernel's OOM killer); the returned list gets
    the RSS it was killed at."""
    killed: list[int] = []

    def watch() -> None:
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
            except (OSError, StopIteration):
                return
            if rss > limit:
                killed.append(rss)
                print(f"== killing pid {proc.pid}: RSS {rss / GIB:.1f} GiB > limit {limit / GIB:.1f} GiB", flush=True)
                proc.kill()
                return
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def side_by_side(args: argparse.Namespace, fw: float, fr: float) -> None:
    """Run each row in a fresh process and print the comparison table with the throughput ratio."""
    here = os.path.abspath(__file__)
    pythons = {"ours": sys.executable, "glibc-heap": sys.executable, "zero-infinity": args.ds_python or sys.executable}
    results = {}
    for name in ("ours", args.peer):
        sub = os.path.join(args.dir, f"row-{name}")
        os.makedirs(sub, exist_ok=True)
        cmd = [pythons[name], here, *sys.argv[1:], "--row", name, "--dir", sub, "--floor-bps", f"{fw},{fr}"]
        print(f"\n== row {name}: {' '.join(cmd)} (load {os.getloadavg()})", flush=True)
        t = time.perf_counter()
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # DeepSpeed's CPU Adam uses OpenMP
        if name == "glibc-heap":  # glibc's own dynamic threshold, up to 32 MiB: chunks from the heap
            env["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        killed = _watch_rss(proc, args.rss_limit_gib * GIB)
        result = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            else:
                print(f"[{name}] {line}", end="", flush=True)
        rc = proc.wait()
        shutil.rmtree(sub, ignore_errors=True)
        print(f"== row {name}: exit {rc} after {time.perf_counter() - t:.0f} s (load {os.getloadavg()})", flush=True)
        if result is None and killed:
            result = dict(
                row=name, failed=f"killed by the bench at {killed[0] / GIB:.1f} GiB RSS (limit --rss-limit-gib)"
            )
        if result is None:
            result = dict(row=name, failed=f"exit status {rc}, no result (see the [{name}] lines above)")
        results[name] = result

    ram = mem_total()
    print(f"\n| quantity | ours (Gemini disk tier) | {args.peer} |\n|---|---|---|")

    def cell(r: dict, f) -> str:
        return r["failed"] if "failed" in r else f(r)

    ours, peer = results["ours"], results[args.peer]
    table = [
        ("parameters", lambda r: f"{r['n_params'] / 1e9:.3f} B ({r['layers']} x {r['width']}, vocab {args.vocab}, seq {args.seq}); "
         f"states {16 * r['n_params'] / GIB:.1f} GiB = {16 * r['n_params'] / ram:.2f}x RAM"),
        ("configuration", lambda r: r["detail"]),
        ("setup", lambda r: f"{r['setup_s']:.0f} s"),
        ("loss by step", lambda r: " -> ".join(f"{x['loss']:.3f}" for x in r["rows"])),
        ("s/step (steps after the first)", lambda r: ", ".join(f"{x['step_s']:.1f}" for x in steady(r["rows"])) +
         f" (first {r['rows'][0]['step_s']:.1f})"),
        ("process CPU s/step, all threads (steps after the first)", lambda r: ", ".join(f"{x['cpu_s']:.1f}" for x in steady(r["rows"]))),
        ("forward+backward / optimizer (last step)", lambda r: f"{r['rows'][-1]['fwd_bwd_s']:.1f} s / {r['rows'][-1]['optim_s']:.1f} s"),
        ("I/O wait forward+backward / optimizer (last step)", lambda r: f"{r['rows'][-1]['io_wait_fwd_bwd_s']:.1f} s / "
         f"{r['rows'][-1]['io_wait_optim_s']:.1f} s" if "io_wait_optim_s" in r["rows"][-1] else "not counted"),
        ("peak RSS (VmHWM) / RAM", lambda r: f"{r['hwm'] / GIB:.2f} GiB = {r['hwm'] / ram:.2f}x"),
        ("peak RSS over the process before GeminiDDP / model states", lambda r: f"{(r['hwm'] - r['hwm_before']) / 2**20:.0f} MiB = "
         f"{(r['hwm'] - r['hwm_before']) / (16 * r['n_params']):.2f}x" if "hwm_before" in r else "not measured"),
        ("disk files", lambda r: f"{r['disk_file_gb']:.1f} GB"),
        ("block-device bytes per step (last, /proc/self/io)", lambda r: f"read {r['rows'][-1]['io_read_gb']:.1f} GB, "
         f"written {r['rows'][-1]['io_written_gb']:.1f} GB"),
    ]  # fmt: skip
    for k, f in table:
        print(f"| {k} | {cell(ours, f)} | {cell(peer, f)} |")
    print(f"| raw O_DIRECT floor (same run) | write {fw / 1e9:.2f} GB/s, read {fr / 1e9:.2f} GB/s | |")
    if "failed" not in ours and "failed" not in peer:
        a = sum(x["step_s"] for x in steady(ours["rows"])) / len(steady(ours["rows"]))
        b = sum(x["step_s"] for x in steady(peer["rows"])) / len(steady(peer["rows"]))
        print(
            f"| **throughput ours / {args.peer}** | **{b / a:.2f}x** ({a:.1f} vs {b:.1f} s/step, mean after the first step) | |"
        )
        ca = sum(x["cpu_s"] for x in steady(ours["rows"])) / len(steady(ours["rows"]))
        cb = sum(x["cpu_s"] for x in steady(peer["rows"])) / len(steady(peer["rows"]))
        print(f"| CPU time {args.peer} / ours | {cb / ca:.2f}x ({ca:.1f} vs {cb:.1f} CPU s/step) | |")


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
    ap.add_argument("--disk-prefetch", type=int, default=2, help="GeminiDDP disk_prefetch (chunks read ahead)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--peer", choices=("zero-infinity", "glibc-heap"), default=None,
                    help="also run DeepSpeed ZeRO-Infinity (or ours with glibc's heap for chunk buffers) on the same "
                         "model, each row in a fresh process")  # fmt: skip
    ap.add_argument("--ds-python", default=None, help="python of the venv with deepspeed (default: this one)")
    ap.add_argument(
        "--ds-buffers",
        type=int,
        default=8,
        help="offload_param.buffer_count (at least (max_live + prefetch) / smallest swapped parameter + 2)",
    )
    ap.add_argument("--ds-buffer-size", type=float, default=1.1e7, help="offload_param.buffer_size (>= largest param)")
    ap.add_argument("--ds-max-live", type=float, default=2e7, help="stage3_max_live_parameters (>= 2x largest)")
    ap.add_argument("--ds-prefetch", type=float, default=1e7, help="stage3_prefetch_bucket_size (>= largest)")
    ap.add_argument("--ds-sub-group", type=float, default=2e7, help="sub_group_size (>= largest)")
    ap.add_argument("--rss-limit-gib", type=float, default=0.85 * mem_total() / GIB,
                    help="a row whose RSS passes this is killed and reported as failed (default 0.85x RAM)")  # fmt: skip
    ap.add_argument("--row", choices=("ours", "glibc-heap", "zero-infinity"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--floor-bps", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.row is not None:  # one row of a side-by-side run, in its own process
        fw, fr = map(float, args.floor_bps.split(","))
        result = run_zero_infinity(args) if args.row == "zero-infinity" else run_ours(args, fw, fr)
        print("RESULT " + json.dumps(result), flush=True)
        return

    ram = mem_total()
    os.makedirs(args.dir, exist_ok=True)
    free0 = shutil.disk_usage(args.dir).free
    print(f"machine: RAM {ram / GIB:.1f} GiB, {os.cpu_count()} cores, load {os.getloadavg()}, free on {args.dir} "
          f"{free0 / 1e9:.1f} GB, torch threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    fw, fr = raw_floor(args.dir, int(args.floor_gib * GIB))
    print(f"raw O_DIRECT floor: write {fw / 1e9:.2f} GB/s, read {fr / 1e9:.2f} GB/s", flush=True)
    if args.peer:
        side_by_side(args, fw, fr)
        return

    res = run_ours(args, fw, fr)
    rows, n_params, layers, width = res["rows"], res["n_params"], res["layers"], res["width"]
    states = 16 * n_params
    hwm = res["hwm"]
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
    print(f"\nfree on {args.dir} after: {shutil.disk_usage(args.dir).free / 1e9:.1f} GB", flush=True)


if __name__ == "__main__":
    main()
