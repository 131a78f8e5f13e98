"""The headline on one card: how large a GPT trains, and how fast, per engine, in one short run (#28).

Run on a CUDA machine (about 8 minutes; one table per section, ratios to plain PyTorch)::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/gpu_bench.py
    PYTHONPATH=... OPENFOLD_PATH=/path/to/openfold python tools/gpu_bench.py --sections fastfold

or dry-run every row at tiny sizes on the CPU (what ``test_colossalai_gpu_bench.py`` does)::

    python tools/gpu_bench.py --device cpu --dry-run

Sections:

1. **capacity**: the largest GPT (width grown in steps of 128, depth ``width / 128``, head size 128,
   activation checkpointing, sequence ``--capacity-seq``) that trains two real steps with plain
   PyTorch (bf16 autocast, fp32 AdamW states: 16 B per parameter on the card), ZeRO-3 + CPU
   offload, Gemini ``auto`` and Gemini with its disk tier. Each probe builds on the meta device and
   runs in a fresh process (an out-of-memory error leaves nothing behind); the size doubles until a
   probe fails, then is bisected on a log scale. The row reports the largest size that trained as
   parameters and as a multiple of plain PyTorch's, with the probe's device peak and host peak RSS.
   A search cut short by ``--capacity-s`` says so (the figure is then a lower bound).
2. **throughput**: a 1.3 B GPT (2048 x 24) and a Llama-style 1.1 B model (TinyLlama's shape, grouped
   key/value heads, Hugging Face ``LlamaForCausalLM``) at sequence 2048 in bf16: tokens/s and MFU
   (``6 N + 12 L d T`` FLOPs per token over the card's dense bf16 peak) for plain PyTorch, plain
   PyTorch under ``torch.compile``, FSDP2 (``fully_shard`` per block, one GPU), ZeRO-2, Gemini with a
   roomy budget and Gemini under pressure (static placement, two thirds of the optimizer blocks, i.e.
   half the model states, on the host). For the pressure row: bytes moved per step and the share of
   copy time hidden behind compute, ``1 - (t_pressure - t_roomy) / copy_s`` (``copy_s`` from
   ``GeminiStats.transfer_seconds``).
3. **fastfold**: ``packages/fastfold/bench/bench_openfold_cuda.py`` (FastFold's training step next
   to OpenFold's), when CUDA and ``OPENFOLD_PATH`` are there.

``--dry-run`` shrinks every size (tiny widths, sequence 64, a few probes) so the whole script runs
in well under a minute on a CPU: it checks that every row runs, not what it measures. On the CPU the
"card" is host memory, so capacity there means nothing; the figures worth reading come from a GPU,
named in the table's header. ``faulthandler`` ends a hung run at ``--time-limit`` with every
thread's stack.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CAPACITY_ENGINES = ("torch", "zero3-offload", "gemini-auto", "gemini-disk")
THROUGHPUT_ENGINES = ("torch", "torch-compile", "fsdp2", "zero2", "gemini-roomy", "gemini-pressure")
PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12,
             "3090": 71e12}  # fmt: skip
"""Dense bf16 tensor-core peaks (FLOP/s) by a substring of the card's name (the first match: PCIe
parts before SXM ones)."""


# -- shared helpers ----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device) -> float | None:
    """The card's dense bf16 peak, or ``None`` (the CPU, an unknown card: MFU is not printed)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def rss_peak() -> int:
    from colossal.comm.memory import rss_and_peak_bytes

    return rss_and_peak_bytes()[1]


def gpt_shape(params: float, vocab: int, seq: int, dry: bool) -> tuple[int, int, int]:
    """``(n_layer, n_embd, n_head)`` of the smallest GPT of the family with at least ``params``."""
    head = 16 if dry else 128  # the width grows by one head at a time: the heads always divide it
    d = head * 4 if dry else head
    while True:
        layers = max(2, d // 128)
        if 12 * layers * d * d + (vocab + seq) * d >= params:
            return layers, d, d // head
        d += head


def init_(name: str, t: torch.Tensor) -> None:
    """GPT-2's initialisation of one tensor (Gemini's ``param_init_fn`` and the other rows alike)."""
    with torch.no_grad():
        if t.dim() >= 2:
            t.normal_(0.0, 0.02)
        elif name.endswith("weight"):
            t.fill_(1.0)
        else:
            t.zero_()


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def fmt_params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


# -- capacity: one probe per process -------------------------------------------------------------------
def probe(spec: dict) -> dict:
    """Train ``spec``'s GPT for two steps under ``spec["engine"]``; the figures of the run."""
    from colossalai.models import GPT, GPTConfig

    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq"], n_embd=spec["width"], n_layer=spec["layers"],
                    n_head=spec["heads"], activation_checkpointing=True)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    engine = spec["engine"]
    torch.manual_seed(0)
    if engine == "torch":
        model.materialize(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step(x, y):
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif engine == "zero3-offload":
        from colossal.optim import HybridAdam
        from colossal.zero import ZeroOptimizer

        model.materialize(device)  # ZeRO works where the parameters are: the fp32 build bounds its size
        zero = ZeroOptimizer(HybridAdam(model.parameters(), lr=1e-4), model, stage=3, offload=True,
                             mixed_precision=dtype)  # fmt: skip

        def step(x, y):
            zero.backward(lm_loss(model(x), y))
            zero.step()
            zero.zero_grad()

    else:
        from colossal.gemini import GeminiDDP, GeminiOptimizer
        from colossal.optim import HybridAdam

        kw = dict(placement="auto", mixed_precision=dtype, param_init_fn=init_, device=device)
        if device.type == "cpu":
            kw["device_memory_budget"] = spec["cpu_budget"]
        if engine == "gemini-disk":
            kw.update(disk_dir=spec["disk_dir"], host_memory_budget=spec["host_budget"])
        gem = GeminiDDP(model, **kw)
        gopt = GeminiOptimizer(HybridAdam(gem.parameters(), lr=1e-4, flatten=False), gem)
        model = gem

        def step(x, y):
            gopt.backward(lm_loss(model(x), y))
            gopt.step()
            gopt.zero_grad()

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
    y = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
    times = []
    for _ in range(2):
        sync(device)
        t = time.perf_counter()
        step(x, y)
        sync(device)
        times.append(time.perf_counter() - t)
    dev_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(ok=True, params=n, step_s=times[-1], device_peak=dev_peak, rss_peak=rss_peak())


def run_probe(spec: dict, timeout: float, fresh: bool = True) -> dict:
    """:func:`probe` in a fresh process (or this one: ``fresh=False``); a failure (out of memory, a
    budget error) is ``ok=False`` with the last line of its error."""
    if not fresh:
        try:
            return probe(spec)
        except Exception as e:  # noqa: BLE001 - any failure of a probe is a size that did not train
            return dict(ok=False, why=f"{type(e).__name__}: {str(e)[:140]}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", json.dumps(spec)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(ok=False, why=f"timed out after {timeout:.0f} s")
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(ok=False, why=last[:160])


def _attempt(engine: str, args: argparse.Namespace, device: torch.device, scratch: str, tried: list, params: float):
    """One probe of ``engine`` at ``params``: appended to ``tried``; whether it trained."""
    layers, width, heads = gpt_shape(params, args.vocab, args.capacity_seq, args.dry_run)
    spec = dict(engine=engine, device=str(device), vocab=args.vocab, seq=args.capacity_seq, batch=1, layers=layers,
                width=width, heads=heads, disk_dir=scratch, host_budget=args.host_budget,
                cpu_budget=args.cpu_budget)  # fmt: skip
    # the dry run starts one process (the path a GPU run takes) and probes the rest in this one
    res = run_probe(spec, args.probe_timeout, fresh=not args.dry_run or engine == "torch")
    res.update(layers=layers, width=width)
    tried.append(res)
    print(f"  capacity {engine}: {layers} x {width}: {'trained' if res['ok'] else res['why']}", flush=True)
    return res["ok"]


def capacity(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Per engine: grow the size until a probe fails, then bisect; the largest that trained."""
    rows = []
    scratch = tempfile.mkdtemp(prefix="gpu_bench_disk_")
    for engine in CAPACITY_ENGINES:
        start_t, tried = time.perf_counter(), []
        good, bad, target, cut = None, None, args.start_params, False
        attempt = functools.partial(_attempt, engine, args, device, scratch, tried)

        while target <= args.max_params:  # doubling
            if time.perf_counter() - start_t > args.capacity_s:
                cut = True
                break
            if attempt(target):
                good = tried[-1]
                target *= 2
            else:
                bad = target
                break
        lo = good["params"] if good else None
        for _ in range(args.bisect):  # log-scale bisection between the last good and the first bad size
            if lo is None or bad is None or time.perf_counter() - start_t > args.capacity_s:
                cut = cut or (lo is not None and bad is not None)
                break
            mid = math.sqrt(lo * bad)
            if mid / lo < 1.05:
                break
            if attempt(mid):
                good, lo = tried[-1], tried[-1]["params"]
            else:
                bad = mid
        stop = next((r["why"] for r in tried if not r["ok"]), "-")
        rows.append(dict(engine=engine, best=good, cut=cut, hit_max=bad is None and not cut, probes=len(tried),
                         stop=stop))  # fmt: skip
        # one line per engine as soon as it is known: a run ended by --time-limit keeps what it measured
        best = f"{fmt_params(good['params'])} ({good['layers']} x {good['width']})" if good else "none trained"
        print(f"  capacity {engine}: largest that trained {best}; stopped by: {stop}", flush=True)
    return rows


def print_capacity(rows: list[dict], card: str) -> None:
    base = next((r["best"]["params"] for r in rows if r["engine"] == "torch" and r["best"]), None)
    print(f"\n## capacity on {card}\n")
    print("| engine | largest GPT that trained | x plain PyTorch | device peak | host peak RSS | probes | stopped by |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["best"]
        if b is None:
            print(f"| {r['engine']} | none trained | - | - | - | {r['probes']} | {r['stop']} |")
            continue
        note = " (lower bound: time)" if r["cut"] else " (the --max-params cap)" if r["hit_max"] else ""
        ratio = f"{b['params'] / base:.1f}x" if base else "-"
        peaks = f"{fmt_bytes(b['device_peak'])} | {fmt_bytes(b['rss_peak'])}"
        print(f"| {r['engine']} | {fmt_params(b['params'])} ({b['layers']} x {b['width']}){note} | {ratio} | "
              f"{peaks} | {r['probes']} | {r['stop']} |")  # fmt: skip


# -- throughput: in this process, one row after another -----------------------------------------------
def build_model(kind: str, args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """A fresh model on ``device`` (fp32 weights) and its shape (for the FLOPs count)."""
    torch.manual_seed(0)
    if kind == "gpt":
        from colossalai.models import GPT, GPTConfig

        d, layers, heads, vocab = (64, 2, 4, 256) if args.dry_run else (2048, 24, 16, 50304)
        cfg = GPTConfig(vocab_size=vocab, block_size=args.seq, n_embd=d, n_layer=layers, n_head=heads,
                        activation_checkpointing=False)  # fmt: skip
        with torch.device(device):
            model = GPT(cfg)
        return model, dict(layers=layers, width=d, vocab=vocab, blocks=lambda m: list(m.blocks))
    import transformers

    d, inter, layers, heads, kv, vocab = (64, 128, 2, 4, 2, 256) if args.dry_run else (2048, 5632, 22, 32, 4, 32000)
    cfg = transformers.LlamaConfig(hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=args.seq, attn_implementation="sdpa")  # fmt: skip
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model, dict(layers=layers, width=d, vocab=vocab, blocks=lambda m: list(m.model.layers))


def forward_loss(kind: str, model, x, y) -> torch.Tensor:
    if kind == "gpt":
        return lm_loss(model(x), y)
    return lm_loss(model(input_ids=x).logits, y)


def throughput_row(kind: str, engine: str, args: argparse.Namespace, device: torch.device) -> dict:
    """tokens/s of ``engine`` on ``kind`` (median step after the warm-up)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, shape = build_model(kind, args, device)
    n = sum(p.numel() for p in model.parameters())
    extra = {}
    autocast = torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")
    if engine in ("torch", "torch-compile"):
        fwd = torch.compile(model, backend=args.compile_backend) if engine == "torch-compile" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step(x, y):
            with autocast:
                loss = forward_loss(kind, fwd, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from colossal.comm import ensure_process_group

        ensure_process_group("gpu_bench")
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in shape["blocks"](model):
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step(x, y):
            forward_loss(kind, model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif engine == "zero2":
        from colossal.zero import ZeroOptimizer

        zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model, stage=2, mixed_precision=dtype)

        def step(x, y):
            zero.backward(forward_loss(kind, model, x, y))
            zero.step()
            zero.zero_grad()

    else:
        from colossal.gemini import GeminiDDP, GeminiOptimizer
        from colossal.optim import HybridAdam

        kw = dict(mixed_precision=dtype, device=device)
        if engine == "gemini-pressure":  # two thirds of the optimizer blocks (12 of 16 B): half the states
            kw.update(placement="static", offload_optim_frac=2 / 3)
        else:
            kw.update(placement="auto")
        if device.type == "cpu":
            kw["device_memory_budget"] = args.cpu_budget
        gem = GeminiDDP(model, **kw)
        gopt = GeminiOptimizer(HybridAdam(gem.parameters(), lr=1e-4, flatten=False), gem)

        def step(x, y):
            gopt.backward(forward_loss(kind, gem, x, y))
            gopt.step()
            gopt.zero_grad()

        extra["stats"] = lambda: gem.stats_history[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, shape["vocab"], (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, shape["vocab"], (args.batch, args.seq), generator=g).to(device)
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        t = time.perf_counter()
        step(x, y)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    t = statistics.median(times)
    tokens = args.batch * args.seq
    flops = (6 * n + 12 * shape["layers"] * shape["width"] * args.seq) * tokens
    peak = peak_flops(device)
    row = dict(kind=kind, engine=engine, params=n, step_s=t, tokens_per_s=tokens / t,
               mfu=flops / t / peak if peak else None)  # fmt: skip
    if "stats" in extra:
        s = extra["stats"]()
        row.update(moved=s.bytes_to_device + s.bytes_to_host, copy_s=s.transfer_seconds)
    return row


def throughput(args: argparse.Namespace, device: torch.device) -> list[dict]:
    rows = []
    for kind in ("gpt", "llama"):
        for engine in THROUGHPUT_ENGINES:
            try:
                rows.append(throughput_row(kind, engine, args, device))
            except Exception as e:  # noqa: BLE001 - a row that cannot run here says why; the next one runs
                rows.append(dict(kind=kind, engine=engine, failed=f"{type(e).__name__}: {str(e)[:120]}"))
            print(f"  throughput {kind} {engine}: {rows[-1].get('failed') or 'done'}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_throughput(rows: list[dict], card: str, args: argparse.Namespace) -> None:
    print(f"\n## throughput on {card} (sequence {args.seq}, batch {args.batch}, median of {args.steps} steps)\n")
    print("| model | engine | tokens/s | x plain PyTorch | MFU | copies per step | copy time hidden |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("gpt", "llama"):
        mine = {r["engine"]: r for r in rows if r["kind"] == kind}
        base = mine.get("torch", {}).get("tokens_per_s")
        for engine in THROUGHPUT_ENGINES:
            r = mine[engine]
            if "failed" in r:
                print(f"| {kind} | {engine} | failed: {r['failed']} | | | | |")
                continue
            ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            moved = fmt_bytes(r["moved"]) if "moved" in r else "-"
            hidden = "-"
            roomy = mine.get("gemini-roomy", {})
            if engine == "gemini-pressure" and r.get("copy_s") and "step_s" in roomy:
                hidden = f"{100 * max(0.0, 1 - max(0.0, r['step_s'] - roomy['step_s']) / r['copy_s']):.0f}%"
            print(f"| {kind} {fmt_params(r['params'])} | {engine} | {r['tokens_per_s']:.0f} | {ratio} | {mfu} | "
                  f"{moved} | {hidden} |")  # fmt: skip


def fastfold(device: torch.device) -> None:
    print("\n## fastfold\n")
    script = ROOT / "packages" / "fastfold" / "bench" / "bench_openfold_cuda.py"
    if device.type != "cuda" or not os.environ.get("OPENFOLD_PATH"):
        print(f"skipped: needs CUDA and OPENFOLD_PATH (then runs {script.relative_to(ROOT)})")
        return
    subprocess.run([sys.executable, str(script)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes: check every row runs (CPU)")
    ap.add_argument("--sections", default="capacity,throughput,fastfold")
    ap.add_argument("--time-limit", type=float, default=600, help="seconds before faulthandler ends the run")
    ap.add_argument("--capacity-s", type=float, default=60, help="seconds of probing per capacity engine")
    ap.add_argument("--capacity-seq", type=int, default=None, help="sequence of the capacity probes (1024)")
    ap.add_argument("--start-params", type=float, default=None, help="first probe's size (1e9)")
    ap.add_argument("--max-params", type=float, default=None, help="largest size probed (2e11)")
    ap.add_argument("--bisect", type=int, default=3, help="bisection probes after the doubling")
    ap.add_argument("--probe-timeout", type=float, default=120, help="seconds one probe may take")
    ap.add_argument("--host-budget", default="48GiB", help="Gemini disk tier's host_memory_budget")
    ap.add_argument("--cpu-budget", default="64MiB", help="Gemini's device budget when the device is the CPU")
    ap.add_argument("--seq", type=int, default=None, help="throughput sequence (2048)")
    ap.add_argument("--batch", type=int, default=None, help="throughput batch (4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed throughput steps (5)")
    ap.add_argument("--vocab", type=int, default=None, help="capacity vocabulary (50304)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; eager on the CPU)")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe is not None:
        with contextlib.suppress(OSError, AttributeError):  # die with the parent (a --time-limit exit)
            ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        print("RESULT " + json.dumps(probe(json.loads(args.probe))), flush=True)
        return
    dry = args.dry_run
    defaults = dict(capacity_seq=(64, 1024), start_params=(2e5, 1e9), max_params=(2e5, 2e11), seq=(64, 2048),
                    batch=(2, 4), steps=(1, 5), vocab=(256, 50304))  # fmt: skip
    for k, (small, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, small if dry else full)
    if dry:
        args.bisect, args.warmup = min(args.bisect, 1), min(args.warmup, 1)
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device.startswith("cuda") else "eager"
    faulthandler.dump_traceback_later(args.time_limit, exit=True)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"the CPU ({os.cpu_count()} cores)"
    print(f"gpu_bench on {card}, torch {torch.__version__}{' (dry run: tiny sizes)' if dry else ''}", flush=True)
    sections = args.sections.split(",")
    if "capacity" in sections:
        print_capacity(capacity(args, device), card)
    if "throughput" in sections:
        print_throughput(throughput(args, device), card, args)
    if "fastfold" in sections:
        fastfold(device)


if __name__ == "__main__":
    main()
