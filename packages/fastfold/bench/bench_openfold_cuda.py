"""fastfold against OpenFold on one CUDA device, side by side in one process: the Evoformer stack of
``bench_openfold.py`` (model_1 sizes, the same random weights through :mod:`fastfold.weights`, the same
inputs), inference per configuration and a checkpointed training step, printing fastfold/OpenFold
ratios of time (CUDA events, median of ``--repeats`` after ``--warmup``) and of peak activation memory
(``torch.cuda.max_memory_allocated`` above the weights and inputs), plus the outputs' largest
relative difference.

On a GPU one process is enough: the caching allocator's statistics are per measurement (reset before
each), unlike a CPU process's RSS. OpenFold runs its plain PyTorch attention (its CUDA extension
``attn_core_inplace_cuda`` is replaced by an empty stand-in module, as on CPU), so this compares the
two Python implementations on the same torch, not OpenFold's hand-written kernels. Needs
``OPENFOLD_PATH`` (a source tree holding ``openfold/``) and ``ml_collections dm-tree einops scipy``.

    OPENFOLD_PATH=/path/to/openfold python packages/fastfold/bench/bench_openfold_cuda.py
    OPENFOLD_PATH=... python packages/fastfold/bench/bench_openfold_cuda.py --n-res 256 512 1024 --chunk-size 64
    OPENFOLD_PATH=... python packages/fastfold/bench/bench_openfold_cuda.py --profile 128    # host vs kernel time
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve()
MiB = 1 << 20


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-res", type=int, nargs="*", default=[256, 512])
    p.add_argument("--n-seq", type=int, default=16)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (fastest median kept)")
    p.add_argument("--train-n-res", type=int, nargs="*", default=[128, 256])
    p.add_argument("--check-n-res", type=int, default=64, help="n_res of the output/gradient equality check")
    p.add_argument(
        "--profile", type=int, default=None, metavar="N_RES", help="only profile 2 training steps of each at N_RES"
    )
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script (no memory figures)")
    return p.parse_args(argv)


def _timed(fn, warmup, repeats, device):
    """(median seconds, peak bytes above the allocation before the call) of ``fn()`` on CUDA."""
    import time

    import torch

    for _ in range(warmup):
        out = fn()
        del out
    if device.type != "cuda":  # the dry run
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), 0
    times = []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        del out
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def _train_loss(impl, model, m, z, msa_mask, pair_mask):
    """The training forward's loss (inputs needing grad, as the embedders' outputs do)."""
    import bench_openfold as b

    m, z = m.clone().requires_grad_(), z.clone().requires_grad_()
    if impl == "fastfold":
        return b._train_loss(*model(m, z, msa_mask, pair_mask, checkpoint=True))
    return b._train_loss(*model(m, z, msa_mask, pair_mask, chunk_size=None))


def _alternating(calls, a, device):
    """``{impl: (seconds, bytes)}``: each call timed ``--rounds`` times, sides alternating (a slow
    spell of the host, which launches the kernels, hits one round, not one side); fastest median."""
    import torch

    res = {}
    for _ in range(a.rounds):
        for impl, fn in calls.items():
            try:
                t, mem = _timed(fn, a.warmup, a.repeats, device)
            except torch.OutOfMemoryError:
                t = mem = float("inf")
                torch.cuda.empty_cache()
            old = res.get(impl, (float("inf"), 0))
            res[impl] = (min(old[0], t), max(old[1], mem))
    return res


def _profile(models, n_res, a, device):
    """Kernels per step, their device time and the host's CPU time for 2 training steps of each
    side (after 3 unprofiled ones), from ``torch.profiler``."""
    import bench_openfold as b
    import torch
    from torch.profiler import ProfilerActivity, profile

    inputs = [t.to(device) for t in b._inputs(a.n_seq, n_res)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for impl, model in models:
        model.train()

        def step(impl=impl, model=model):
            model.zero_grad(set_to_none=True)
            _train_loss(impl, model, *inputs).backward()

        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(2):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        host = sum(e.self_cpu_time_total for e in events) / 2e3
        device_ms = sum(e.self_device_time_total for e in kernels) / 2e3
        print(
            f"{impl} training step n_res {n_res}: {sum(e.count for e in kernels) // 2} kernels, "
            f"kernel time {device_ms:.1f} ms, host CPU {host:.1f} ms (per step, under the profiler)"
        )


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _row(label, ff, of):
    (tf, mf), (to, mo) = ff, of
    print(
        f"| {label} | {tf * 1e3:.1f} / {to * 1e3:.1f} = **{tf / to:.2f}** "
        f"| {mf / MiB:.0f} / {mo / MiB:.0f} = {mf / max(mo, 1):.2f} |",
        flush=True,
    )
    return {"config": label, "fastfold": {"s": tf, "bytes": mf}, "openfold": {"s": to, "bytes": mo}}


def main(argv=None):
    a = _args(argv)
    root = os.environ.get("OPENFOLD_PATH")
    if not root or not (pathlib.Path(root) / "openfold").is_dir():
        print("OPENFOLD_PATH is not set to an OpenFold source tree (github.com/aqlaboratory/openfold): skipped")
        return
    import torch

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped (bench_openfold.py measures the CPU)")
        return
    stub = pathlib.Path(tempfile.mkdtemp())
    (stub / "attn_core_inplace_cuda.py").write_text('"""Stand-in for OpenFold\'s CUDA extension."""\n')
    sys.path[:0] = [root, str(stub), str(HERE.parent)]
    import bench_openfold as b

    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true float32: outputs comparable
    torch.backends.cudnn.allow_tf32 = False
    ff = b._fastfold(a.blocks).eval()
    of = b._openfold(ff).eval()
    ff, of = ff.to(dev), of.to(dev)
    if a.profile:
        _profile((("fastfold", ff), ("openfold", of)), a.profile, a, dev)
        return
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, fp32 (TF32 off), {a.blocks} blocks")
    report = {"device": name, "torch": torch.__version__, "rows": []}

    # equality on the device: outputs of every configuration, gradients of the checkpointed step
    m, z, msa_mask, pair_mask = (t.to(dev) for t in b._inputs(8, a.check_n_res))
    msa_mask[1:, -3:] = 0
    with torch.no_grad():
        ref = b._forward("openfold", of, m, z, msa_mask, pair_mask, None, False)
        for name, (c, inplace) in b.CONFIGS.items():
            c = a.chunk_size if c == "C" else c
            out = b._forward("fastfold", ff, m, z, msa_mask, pair_mask, c, inplace)
            rel = max(_rel(x, y) for x, y in zip(out, ref))
            print(f"outputs fastfold vs OpenFold, {name}, n_res {a.check_n_res}: max rel diff {rel:.2e}")
            report.setdefault("equality", {})[name] = rel
    ff.train(), of.train()
    grads = {}
    for impl, model in (("fastfold", ff), ("openfold", of)):
        model.zero_grad(set_to_none=True)
        _train_loss(impl, model, m, z, msa_mask, pair_mask).backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    rel = b._grad_rel(grads["fastfold"], grads["openfold"])
    print(f"training gradients fastfold vs OpenFold (checkpointed), n_res {a.check_n_res}: max rel diff {rel:.2e}")
    report.setdefault("equality", {})["training gradients"] = rel
    del grads
    ff.eval(), of.eval()
    models = (("fastfold", ff), ("openfold", of))

    print("\n| config | ms fastfold / OpenFold | peak activation MiB |\n|---|---|---|")
    for n_res in a.n_res:
        inputs = [t.to(dev) for t in b._inputs(a.n_seq, n_res)]
        for name, (c, inplace) in b.CONFIGS.items():
            c = a.chunk_size if c == "C" else c
            calls = {impl: functools.partial(b._forward, impl, model, *inputs, c, inplace) for impl, model in models}
            with torch.no_grad():
                res = _alternating(calls, a, dev)
            label = f"n_res {n_res}, " + (name if c is None else name.replace("chunk", f"chunk {c}"))
            report["rows"].append(_row(label, res["fastfold"], res["openfold"]))
    ff.train(), of.train()
    opt = {impl: torch.optim.SGD(mod.parameters(), lr=1e-4) for impl, mod in (("fastfold", ff), ("openfold", of))}
    for n_res in a.train_n_res:
        m, z, msa_mask, pair_mask = (t.to(dev) for t in b._inputs(a.n_seq, n_res))

        def step(impl, model, m=m, z=z, msa_mask=msa_mask, pair_mask=pair_mask):
            opt[impl].zero_grad(set_to_none=True)
            _train_loss(impl, model, m, z, msa_mask, pair_mask).backward()
            opt[impl].step()

        res = _alternating({impl: functools.partial(step, impl, model) for impl, model in models}, a, dev)
        report["rows"].append(_row(f"training step n_res {n_res}, checkpointed", res["fastfold"], res["openfold"]))
    out = pathlib.Path(os.environ.get("COLOSSAL_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fastfold_vs_openfold_cuda.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
