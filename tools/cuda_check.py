"""Exercise the device paths of every package in one process and compare each against a reference.

Run on a CUDA machine (world size 1, NCCL) or, to debug the script itself, on the CPU (gloo)::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/cuda_check.py            # cuda if available
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/cuda_check.py --device cpu --quick

Every check prints one line, ``PASS|FAIL name: figures``; an exception prints its traceback and
marks the check FAIL, and the next check runs. The exit status is 1 when any check failed.

Each check compares against an independent reference computed in the same run: plain torch on the
same device (same kernels: tolerances near float32 rounding) or a float64 CPU run of the same
weights (tolerances of float32 rounding amplified by the depth of the computation). The tolerance
of every comparison is printed next to the measured error (``err<=tol``). Times are ratios to the
plain-torch reference measured in the same run (``torch.cuda.synchronize`` around each), peaks
are ``torch.cuda.max_memory_allocated`` above what was allocated before the check (CUDA only).

[Note: time limits]
The GPU run has a few minutes of device time, so a hang must not eat it: each check runs under a
soft ``SIGALRM`` limit (``--check-limit``), checks not started by ``--time-limit`` minus a margin
are reported FAIL (not run), and ``faulthandler`` kills the process with every thread's stack at
``--time-limit`` (a hang inside a C call, e.g. a collective, never returns to Python).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import faulthandler
import functools
import gc
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

MIB = 2**20


# ---------------------------------------------------------------------------------------------------
# Harness: context, figures, comparisons, timing and memory
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Ctx:
    """What every check gets."""

    device: torch.device
    """Compute device of the checks (``cuda:0`` or ``cpu``)."""
    quick: bool
    """Smaller models and fewer steps."""
    tmp: str
    """A scratch directory removed at exit."""
    cache: dict = dataclasses.field(default_factory=dict)
    """References shared between checks (computed once)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Figures:
    """The figures of one check and the comparisons that failed."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.failed: list[str] = []

    def add(self, text: str) -> None:
        """A figure shown on the check's line."""
        self.parts.append(text)

    def close(self, label: str, err: float, tol: float) -> None:
        """Record ``err <= tol`` (a NaN error fails)."""
        ok = err <= tol
        self.parts.append(f"{label} {err:.1e}{'<=' if ok else '>'}{tol:.0e}")
        if not ok:
            self.failed.append(label)

    def expect(self, label: str, ok: bool, detail: str = "") -> None:
        """Record a condition that must hold."""
        self.parts.append(f"{label}={'ok' if ok else 'NO'}{' ' + detail if detail else ''}")
        if not ok:
            self.failed.append(label)


def norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 on the CPU (shapes must agree)."""
    if got.shape != want.shape:
        raise ValueError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    a, b = got.detach().cpu().double(), want.detach().cpu().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float64 on the CPU."""
    a, b = got.detach().cpu().double(), want.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def many_rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Norm-relative error of the concatenation of several tensors."""
    num = sum(((a.detach().cpu().double() - b.detach().cpu().double()) ** 2).sum().item() for a, b in zip(got, want))
    den = sum((b.detach().cpu().double() ** 2).sum().item() for b in want)
    return math.sqrt(num / max(den, 1e-300))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``(fn(), seconds)`` with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


class Peak:
    """Peak device memory above what was allocated on entry (CUDA; ``None`` on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes = device, None

    def __enter__(self) -> Peak:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f}MiB"


def ratio(a: float, b: float) -> str:
    return f"x{a / b:.2f}" if b > 0 else "n/a"


@contextlib.contextmanager
def soft_limit(seconds: int) -> Iterator[None]:
    """Raise ``TimeoutError`` in this (main) thread after ``seconds`` ([Note: time limits])."""

    def expire(signum, frame):
        raise TimeoutError(f"check took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def free(ctx: Ctx) -> None:
    """Drop what the last check left behind, so the next peak starts from a clean allocator."""
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# 1. colossal.optim: HybridAdam, Lamb, Lars on device parameters
# ---------------------------------------------------------------------------------------------------

OPTIM_SHAPES = [(64, 32), (32,), (7, 5, 3), (1000,), (128, 128)]
OPTIM_STEPS = 4


def _optim_tensors(ctx: Ctx, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial weights and per-step gradients (CPU float64, a fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda scale: [torch.randn(s, generator=gen, dtype=torch.float64) * scale for s in OPTIM_SHAPES]
    ws = draw(1.0)
    grads = [draw(0.1) for _ in range(OPTIM_STEPS)]
    return ws, grads


def _drive(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device=p.device, dtype=p.dtype)
        opt.step()


def _step_time(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], ctx: Ctx) -> float:
    """Seconds per step of ``make(params)`` over a few million float32 elements on the device."""
    n = (1 << 20) if ctx.quick else (4 << 20)
    params = [torch.nn.Parameter(torch.randn(n // 4, device=ctx.device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = make(params)
    opt.step()  # state allocation and first-call costs outside the timing
    steps = 3 if ctx.quick else 5
    _, seconds = timed(lambda: [opt.step() for _ in range(steps)], ctx.device)
    return seconds / steps


def check_optim_hybrid_adam(ctx: Ctx, fig: Figures) -> None:
    """HybridAdam over device parameters plus one CPU parameter (the hybrid case) against
    torch.optim.AdamW (single-tensor loop) on the same devices and AdamW on float64 CPU copies."""
    from colossal.optim import HybridAdam

    ws, grads = _optim_tensors(ctx)
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    place = [ctx.device] * (len(ws) - 1) + [torch.device("cpu")]  # the last one stays on the CPU
    ours = [torch.nn.Parameter(w.float().to(d)) for w, d in zip(ws, place)]
    ref = [torch.nn.Parameter(w.float().to(d)) for w, d in zip(ws, place)]
    ref64 = [torch.nn.Parameter(w.clone()) for w in ws]
    _drive(HybridAdam(ours, **kw), ours, grads)
    _drive(torch.optim.AdamW(ref, foreach=False, **kw), ref, grads)
    _drive(torch.optim.AdamW(ref64, foreach=False, **kw), ref64, grads)
    # same fused-vs-loop kernels in float32: a few ulps of the weights
    fig.close("vs AdamW", max(max_rel(p, r) for p, r in zip(ours, ref)), 1e-6)
    fig.close("vs f64", max(max_rel(p, r) for p, r in zip(ours, ref64)), 1e-5)
    _bf16_master(ctx, fig, ws, grads, kw)
    mine = _step_time(lambda ps: HybridAdam(ps, **kw), ctx)
    plain = _step_time(lambda ps: torch.optim.AdamW(ps, **kw), ctx)
    fig.add(f"step t/AdamW(default) {ratio(mine, plain)}")


def _bf16_master(ctx: Ctx, fig: Figures, ws, grads, kw) -> None:
    """bf16 device parameters with fp32 masters: the masters follow AdamW in float32 fed the same
    bf16-rounded gradients, and the bf16 parameters are the masters rounded."""
    from colossal.optim import HybridAdam

    params = [torch.nn.Parameter(w.to(ctx.device, torch.bfloat16)) for w in ws]
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = HybridAdam(params, master_weights=True, **kw)
    _drive(opt, params, grads)
    rounded = [[g.to(torch.bfloat16).float() for g in step] for step in grads]  # what the masters saw
    _drive(torch.optim.AdamW(ref, foreach=False, **kw), ref, rounded)
    masters = [opt.state[p]["master"] for p in params]
    fig.close("bf16 master vs AdamW", max(max_rel(m, r) for m, r in zip(masters, ref)), 1e-6)
    fig.expect("bf16 = master rounded", all(torch.equal(p, m.to(p.dtype)) for p, m in zip(params, masters)))


def _layerwise_check(ctx: Ctx, fig: Figures, cls, kw: dict) -> None:
    """``cls`` on float32 device parameters against ``cls`` on float64 CPU copies (two groups:
    one with the trust ratio, one without and without weight decay)."""
    ws, grads = _optim_tensors(ctx, seed=1)

    def groups(params):
        return [{"params": params[:3]}, {"params": params[3:], "trust_ratio": False, "weight_decay": 0.0}]

    ours = [torch.nn.Parameter(w.float().to(ctx.device)) for w in ws]
    ref64 = [torch.nn.Parameter(w.clone()) for w in ws]
    _drive(cls(groups(ours), **kw), ours, grads)
    _drive(cls(groups(ref64), **kw), ref64, grads)
    fig.close("vs f64", max(max_rel(p, r) for p, r in zip(ours, ref64)), 1e-5)
    mine = _step_time(lambda ps: cls(ps, **kw), ctx)
    plain = _step_time(lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx)
    fig.add(f"step t/AdamW(default) {ratio(mine, plain)}")


def check_optim_lamb(ctx: Ctx, fig: Figures) -> None:
    from colossal.optim import Lamb

    _layerwise_check(ctx, fig, Lamb, dict(lr=1e-2, weight_decay=0.01))


def check_optim_lars(ctx: Ctx, fig: Figures) -> None:
    from colossal.optim import Lars

    _layerwise_check(ctx, fig, Lars, dict(lr=1.0, momentum=0.9, weight_decay=1e-4))


# ---------------------------------------------------------------------------------------------------
# 2. colossalai Booster with every single-process plugin, training the project's GPT
# ---------------------------------------------------------------------------------------------------

GPT_LR, GPT_WD, GPT_STEPS = 3e-3, 0.1, 3


def _gpt_setup(ctx: Ctx) -> dict:
    """The GPT preset, its batch (one fixed batch every step, so the loss must fall)."""
    # few tokens: the weights (3.3 MiB for mini) outweigh the activations, so a device budget
    # below the weights is feasible and forces Gemini to move parameter chunks
    preset, batch, seq = ("tiny", 2, 16) if ctx.quick else ("mini", 4, 32)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (batch, seq + 1), generator=gen)
    return dict(preset=preset, seq=seq, x=idx[:, :-1].contiguous(), y=idx[:, 1:].contiguous())


def _build_gpt(setup: dict):
    from colossalai.models import build_gpt

    return build_gpt(setup["preset"], seed=0, block_size=setup["seq"])


def _criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _train(ctx: Ctx, step: Callable[[], torch.Tensor]) -> tuple[list[float], list[float]]:
    """Losses and synchronised wall times of ``GPT_STEPS`` calls of ``step``."""
    losses, times = [], []
    for _ in range(GPT_STEPS):
        loss, seconds = timed(step, ctx.device)
        losses.append(float(loss))
        times.append(seconds)
    return losses, times


def _gpt_reference(ctx: Ctx) -> dict:
    """Plain torch: the GPT on the device, AdamW, the same batch (computed once per run)."""
    if "gpt_ref" in ctx.cache:
        return ctx.cache["gpt_ref"]
    setup = _gpt_setup(ctx)
    _plain_run(ctx, setup)  # warm-up: first-call costs (kernel loading, allocator) stay out of the times
    with Peak(ctx.device) as peak:
        model, losses, times = _plain_run(ctx, setup)
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    final = _loss_of_weights(ctx, setup, params)
    ctx.cache["gpt_ref"] = dict(setup=setup, losses=losses, times=times, peak=peak.bytes, params=params, final=final)
    return ctx.cache["gpt_ref"]


def _plain_run(ctx: Ctx, setup: dict) -> tuple[torch.nn.Module, list[float], list[float]]:
    x, y = setup["x"].to(ctx.device), setup["y"].to(ctx.device)
    model = _build_gpt(setup).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=GPT_LR, weight_decay=GPT_WD)

    def step():
        loss = _criterion(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, *_train(ctx, step)


def _loss_of_weights(ctx: Ctx, setup: dict, state: dict[str, torch.Tensor]) -> float:
    """The batch's loss under ``state`` loaded into a fresh plain GPT on the device (no grad)."""
    model = _build_gpt(setup)
    model.load_state_dict({k: v.detach().cpu().float() for k, v in state.items()}, strict=False)
    with torch.no_grad():
        return float(_criterion(model.to(ctx.device)(setup["x"].to(ctx.device)), setup["y"].to(ctx.device)))


def _boosted_run(ctx: Ctx, plugin, precision: str | None) -> dict:
    """The same training through ``Booster(plugin)``: losses, times, peak, final full weights."""
    from colossalai import Booster

    ref = _gpt_reference(ctx)
    setup = ref["setup"]
    x, y = setup["x"].to(ctx.device), setup["y"].to(ctx.device)
    with Peak(ctx.device) as peak:
        booster = Booster(plugin=plugin, mixed_precision=precision)
        model = _build_gpt(setup)
        opt = torch.optim.AdamW(model.parameters(), lr=GPT_LR, weight_decay=GPT_WD)
        model, opt, criterion, _, _ = booster.boost(model, opt, _criterion)

        def step():
            loss = criterion(model(x), y)
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        losses, times = _train(ctx, step)
    state = plugin.full_model_state_dict(model.module)
    return dict(losses=losses, times=times, peak=peak.bytes, state=state, plugin=plugin)


# [Note: booster tolerances]
# fp32: every plugin runs the same forward/backward kernels on the same weights; ZeRO, Gemini and
# FSDP copy gradients into flat buffers (a reduction over a world of one is a copy) and step AdamW
# on flat shards (the same elementwise formula, on the CPU for offloaded states), so the losses
# agree to a few float32 ulps. LOSS_TOL = 1e-5 relative leaves room for a reordered reduction and
# is far below what a real bug gives (a wrong or missing update moves the loss by > 1e-4).
# The loss after the last step is computed from the plugin's gathered full state_dict loaded into
# a plain GPT (so it checks the state_dict too). The weights themselves are not compared by norm:
# a gradient that is zero in exact arithmetic (the key-projection biases: a shift of every logit
# of a softmax row) is pure rounding noise, and Adam's first step turns its sign into +-lr, so
# any change of summation order (e.g. atomics in a CUDA attention backward) flips such elements
# by 2 lr without changing the loss. Instead: at most WEIGHT_FRAC of the elements may differ by
# more than 1e-5 relative, and no element by more than one Adam step per step taken.
LOSS_TOL, WEIGHT_FRAC = 1e-5, 1e-3


def _compare_boosted(ctx: Ctx, fig: Figures, ref: dict, got: dict) -> None:
    """Per-step losses, the loss after the last step and the final weights against the plain run,
    plus time and memory ([Note: booster tolerances])."""
    fig.close("loss", max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])), LOSS_TOL)
    missing = sorted(set(ref["params"]) - set(got["state"]))
    unexpected = sorted(set(got["state"]) - set(_build_gpt(ref["setup"]).state_dict()))
    detail = f"missing {missing[:3]} unexpected {unexpected[:3]}" if missing or unexpected else ""
    fig.expect("state_dict keys", not missing and not unexpected, detail)
    final = _loss_of_weights(ctx, ref["setup"], got["state"])
    fig.close("final loss", abs(final - ref["final"]) / abs(ref["final"]), LOSS_TOL)
    names = [n for n in ref["params"] if n in got["state"]]
    diff = torch.cat([(got["state"][n].detach().cpu().float() - ref["params"][n]).abs().flatten() for n in names])
    scale = torch.cat([ref["params"][n].abs().flatten() for n in names])
    frac = (diff > 1e-5 * scale + 1e-7).double().mean().item()
    fig.close("weights differing", frac, WEIGHT_FRAC)
    fig.close("max weight diff/lr", diff.max().item() / GPT_LR, 2.0 * GPT_STEPS)
    fig.add(f"losses {' '.join(f'{v:.5f}' for v in got['losses'])} final {final:.5f}")
    fig.add(f"step t/plain {ratio(sum(got['times'][1:]), sum(ref['times'][1:]))}")
    fig.add(f"peak {mib(got['peak'])} (plain {mib(ref['peak'])})")


def _booster_check(make_plugin: Callable[[Ctx], object], ctx: Ctx, fig: Figures) -> None:
    ref = _gpt_reference(ctx)
    got = _boosted_run(ctx, make_plugin(ctx), None)
    _compare_boosted(ctx, fig, ref, got)
    engine = getattr(got["plugin"], "model", None)
    history = getattr(engine, "stats_history", None)
    if history:
        _gemini_figures(ctx, fig, got["plugin"], history)


def _gemini_figures(ctx: Ctx, fig: Figures, plugin, history: list) -> None:
    """Bytes moved between the tiers over the run; the accounted peak within the budget."""
    last = history[-1]
    if plugin.placement == "auto" and plugin.budget is None:
        ctx.cache["gemini_stats"] = last  # an unconstrained run sizes the budget run
    to_dev, to_host = sum(s.bytes_to_device for s in history), sum(s.bytes_to_host for s in history)
    fig.add(f"moved h2d {mib(to_dev)} d2h {mib(to_host)}")
    fig.add(f"chunks device/host {last.chunks_on_device}/{last.chunks_on_host}")
    peak = max(s.peak_device_bytes for s in history)
    fig.expect("accounted peak<=budget", peak <= last.budget, f"{mib(peak)} of {mib(last.budget)}")


def gemini_budget(ctx: Ctx) -> int:
    """A device budget that holds the activations and half the model data of an unconstrained run
    (measured by ``booster.gemini.auto``; computed there when that check did not run): enough for
    any one operator's chunks, too little for all of them, so chunks must be evicted and refetched."""
    if "gemini_stats" not in ctx.cache:
        _booster_check(lambda c: _gemini(placement="auto"), ctx, Figures())
    stats = ctx.cache["gemini_stats"]
    return stats.peak_non_model_bytes + stats.peak_model_bytes // 2


def _gemini(**kw):
    from colossalai import GeminiPlugin

    return GeminiPlugin(**kw)


def check_booster_bf16(ctx: Ctx, fig: Figures) -> None:
    """GeminiPlugin in bf16: finite losses that fall, within bf16 rounding of the fp32 plain run."""
    from colossalai import GeminiPlugin

    ref = _gpt_reference(ctx)
    got = _boosted_run(ctx, GeminiPlugin(placement="auto"), "bf16")
    losses = got["losses"]
    fig.expect("finite", all(math.isfinite(v) for v in losses))
    fig.expect("decreasing", all(b < a for a, b in zip(losses, losses[1:])))
    # bf16 activations: ~3 significant digits per op, a few % of the loss after a few layers
    fig.close("loss vs fp32", max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])), 3e-2)
    fig.add(f"losses {' '.join(f'{v:.4f}' for v in losses)}")
    fig.add(f"step t/plain-fp32 {ratio(sum(got['times'][1:]), sum(ref['times'][1:]))}")
    fig.add(f"peak {mib(got['peak'])} (plain fp32 {mib(ref['peak'])})")


def _booster_plugins() -> list[tuple[str, Callable[[Ctx], object]]]:
    from colossalai import TorchDDPPlugin, TorchFSDPPlugin, ZeroPlugin

    return [
        ("booster.ddp", lambda c: TorchDDPPlugin()),
        ("booster.gemini.auto", lambda c: _gemini(placement="auto")),
        ("booster.gemini.auto_budget", lambda c: _gemini(placement="auto", device_memory_budget=gemini_budget(c))),
        ("booster.gemini.static", lambda c: _gemini(placement="static")),
        ("booster.gemini.static_offload", lambda c: _gemini(placement="static", offload_param_frac=1.0)),
        ("booster.zero1", lambda c: ZeroPlugin(stage=1)),
        ("booster.zero2", lambda c: ZeroPlugin(stage=2)),
        ("booster.zero3", lambda c: ZeroPlugin(stage=3)),
        ("booster.zero2_offload", lambda c: ZeroPlugin(stage=2, offload=True)),
        ("booster.fsdp", lambda c: TorchFSDPPlugin()),
    ]


# ---------------------------------------------------------------------------------------------------
# 3. fastfold: Evoformer forward / chunked inference / training gradients against float64 CPU
# ---------------------------------------------------------------------------------------------------


def _evo_setup(ctx: Ctx) -> dict:
    """A randomised Evoformer stack (float64 CPU master copy), inputs with some masked entries."""
    from fastfold import EvoformerConfig, EvoformerStack

    small = dict(c_m=64, c_z=32, c_s=64, c_hidden_mul=32, c_hidden_opm=16) if ctx.quick else {}
    cfg = EvoformerConfig(no_blocks=2, msa_dropout=0.0, pair_dropout=0.0, **small)
    n_seq, n_res = 8, (32 if ctx.quick else 64)
    torch.manual_seed(0)
    model = EvoformerStack(cfg).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # AlphaFold zero-initialises output layers: random weights everywhere
        for name, p in model.named_parameters():
            scale = 1.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0  # layer-norm gains near 1
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale + centre)
    m = torch.randn(n_seq, n_res, cfg.c_m, generator=gen, dtype=torch.float64)
    z = torch.randn(n_res, n_res, cfg.c_z, generator=gen, dtype=torch.float64)
    msa_mask = (torch.rand(n_seq, n_res, generator=gen) > 0.1).double()
    pair_mask = (torch.rand(n_res, n_res, generator=gen) > 0.1).double()
    msa_mask[..., 0] = pair_mask[..., 0] = 1.0  # every row keeps a key
    return dict(cfg=cfg, model=model, m=m, z=z, msa_mask=msa_mask, pair_mask=pair_mask)


def _evo(ctx: Ctx) -> dict:
    if "evo" not in ctx.cache:
        ctx.cache["evo"] = _evo_setup(ctx)
    return ctx.cache["evo"]


def _on(ctx: Ctx, evo: dict, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    """A device copy (float32 by default) of the model and the inputs."""
    model = copy.deepcopy(evo["model"]).to(device=ctx.device, dtype=dtype)
    inputs = {k: evo[k].to(device=ctx.device, dtype=dtype, copy=True) for k in ("m", "z", "msa_mask", "pair_mask")}
    return model, inputs


def _evo_reference(ctx: Ctx, masked: bool = True) -> tuple[torch.Tensor, ...]:
    """The float64 CPU forward (no grad), with the masks or without (all ones), computed once."""
    key = f"evo_ref_{masked}"
    if key not in ctx.cache:
        evo = _evo(ctx)
        masks = (evo["msa_mask"], evo["pair_mask"]) if masked else (None, None)
        with torch.no_grad():
            ctx.cache[key] = evo["model"].eval()(evo["m"], evo["z"], *masks)
    return ctx.cache[key]


# float32 against float64 through 2 Evoformer blocks (about 30 matmul/softmax/layer-norm levels,
# inputs and weights of unit scale): the norm-relative error is 3e-7 to 7e-7 on the CPU, outputs
# and gradients alike; 5e-5 leaves a factor 50 for other kernels' rounding (CUDA GEMMs, the fused
# attention) and still fails a TF32 matmul (~1e-3) or any wrong operator (a mask, an epsilon).
EVO_F64_TOL = 5e-5


def check_fastfold_forward(ctx: Ctx, fig: Figures) -> None:
    """Inference forward (fastfold.inference.run_evoformer, unchunked) on the device in float32
    against the float64 CPU forward of the same weights: with masked keys (the biases merged into
    one attention mask) and without masks (the lone pair bias broadcast into the fused kernel)."""
    from fastfold.inference import run_evoformer

    evo, ref = _evo(ctx), _evo_reference(ctx)
    model, x = _on(ctx, evo)
    model.eval()
    args = (x["m"], x["z"], x["msa_mask"], x["pair_mask"])
    run_evoformer(model, *args)  # warm-up: kernel selection and allocator outside the figures
    with Peak(ctx.device) as peak:
        out, seconds, _, _ = run_evoformer(model, *args)
    for name, got, want in zip("mzs", out, ref):
        fig.close(f"{name} vs f64", norm_rel(got, want), EVO_F64_TOL)
    fig.add(f"max|dz|/max|z| {max_rel(out[1], ref[1]):.1e}")
    unmasked = run_evoformer(model, x["m"], x["z"])[0]
    fig.close("unmasked z vs f64", norm_rel(unmasked[1], _evo_reference(ctx, masked=False)[1]), EVO_F64_TOL)
    fig.add(f"fwd {seconds * 1e3:.1f}ms peak {mib(peak.bytes)}")
    ctx.cache["evo_unchunked"] = (out, seconds, peak.bytes)


def check_fastfold_chunked(ctx: Ctx, fig: Figures) -> None:
    """Chunked + in-place inference and the ``max_memory`` chooser equal the unchunked forward."""
    from fastfold.autochunk import choose_chunk_size, estimate_activation_bytes
    from fastfold.inference import run_evoformer

    evo = _evo(ctx)
    if "evo_unchunked" not in ctx.cache:
        check_fastfold_forward(ctx, Figures())
    base, base_s, base_peak = ctx.cache["evo_unchunked"]
    model, x = _on(ctx, evo)
    model.eval()
    args = (x["m"], x["z"], x["msa_mask"], x["pair_mask"])
    cfg, (n_seq, n_res) = evo["cfg"], evo["m"].shape[:2]
    chunk = n_res // 4
    run_evoformer(model, *args, chunk_size=chunk, inplace=True)  # warm-up
    with Peak(ctx.device) as peak:
        out, seconds, _, _ = run_evoformer(model, *args, chunk_size=chunk, inplace=True)
    # chunking only splits batch-like axes: the same sums per element, ~1e-7 (README: 1e-6)
    for name, got, want in zip("mzs", out, base):
        fig.close(f"chunk{chunk}+inplace {name}", norm_rel(got, want), 1e-5)
    budget = estimate_activation_bytes(cfg, n_seq, n_res, n_res // 8, inplace=False)
    chosen = choose_chunk_size(cfg, n_seq, n_res, budget, inplace=False)
    out2, seconds2, _, _ = run_evoformer(model, *args, max_memory=budget)
    fig.close(f"max_memory({mib(budget)}->chunk {chosen}) z", norm_rel(out2[1], base[1]), 1e-5)
    fig.add(f"t chunked/unchunked {ratio(seconds, base_s)}")
    fig.add(f"peak chunked {mib(peak.bytes)} unchunked {mib(base_peak)}")


def _weighted_loss(ctx: Ctx, outputs) -> Callable[..., torch.Tensor]:
    """A loss with fixed random weights on every output (no symmetric cancellation)."""
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]

    def loss(*outs):
        return sum((o * w.to(o.device, o.dtype)).sum() for o, w in zip(outs, ws))

    return loss


def _evo_grad_reference(ctx: Ctx) -> dict[str, torch.Tensor]:
    """Parameter and input gradients of the float64 CPU model (plain autograd), computed once."""
    if "evo_grads" in ctx.cache:
        return ctx.cache["evo_grads"]
    evo = _evo(ctx)
    model = copy.deepcopy(evo["model"]).train()
    m, z = evo["m"].clone().requires_grad_(), evo["z"].clone().requires_grad_()
    outs = model(m, z, evo["msa_mask"], evo["pair_mask"])
    _weighted_loss(ctx, outs)(*outs).backward()
    grads = {n: p.grad for n, p in model.named_parameters()} | {"<m>": m.grad, "<z>": z.grad}
    ctx.cache["evo_grads"] = grads
    return grads


def _evo_train_grads(
    ctx: Ctx, checkpoint: bool, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], float, int | None]:
    """One fastfold.training.train_step on the device (SGD lr 0: gradients kept, weights not moved)."""
    from fastfold.training import train_step

    evo = _evo(ctx)
    model, x = _on(ctx, evo, dtype)
    x["m"].requires_grad_()
    x["z"].requires_grad_()
    loss_fn = _weighted_loss(ctx, _evo_reference(ctx))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(model, x, opt, loss_fn, checkpoint=checkpoint)  # warm-up
    x["m"].grad = x["z"].grad = None
    with Peak(ctx.device) as peak:
        _, seconds = timed(lambda: train_step(model, x, opt, loss_fn, checkpoint=checkpoint), ctx.device)
    grads = {n: p.grad for n, p in model.named_parameters()} | {"<m>": x["m"].grad, "<z>": x["z"].grad}
    return grads, seconds, peak.bytes


def _compare_grads(fig: Figures, label: str, got: dict, want: dict, tol: float = EVO_F64_TOL) -> None:
    names = [n for n in want if want[n] is not None]
    missing = [n for n in names if got.get(n) is None]
    fig.expect(f"{label} all grads", not missing, f"missing {missing[:3]}" if missing else "")
    names = [n for n in names if n not in missing]
    fig.close(f"{label} grads", many_rel([got[n] for n in names], [want[n] for n in names]), tol)
    # per tensor, relative to its own norm floored at 1e-3 of the mean tensor norm: some gradients
    # are zero in exact arithmetic (a bias that shifts all logits of a softmax alike)
    floor = 1e-3 * math.sqrt(sum(want[n].double().norm().item() ** 2 for n in names) / len(names))

    def err(n: str) -> float:
        return (got[n].cpu().double() - want[n]).norm().item() / max(want[n].double().norm().item(), floor)

    worst = max(names, key=err)
    fig.add(f"worst {worst} {err(worst):.1e}")


EVO_GRAD_F64_TOL = 1e-10
"""float64 on the device against float64 on the CPU: the same formulas summed in another order."""

EVO_GRAD_F32_TOL = 2e-3
"""float32 gradients against float64 ones. Loose on purpose: the transitions' ReLU makes the
gradient discontinuous, and a pre-activation that float32 rounding moves across zero changes a
gradient by a step. Measured (2 blocks, n_res 64, max |diff| / max |grad|, ``bench_openfold.py``'s
weights and inputs): fastfold 4.4e-5 and OpenFold 4.4e-5 on one machine's CPU, 4.4e-5 and 9.0e-6 on
another's, 5e-7 and 2.6e-5 on an H200; this check's inputs give 2e-4 norm-relative on the H200 and
6e-7 on a CPU. The float64 rows check the code paths themselves."""


def check_fastfold_training(ctx: Ctx, fig: Figures) -> None:
    """Training-step gradients (plain, checkpointed, and with the fused attention forced, the path
    large crops take) on the device in float64 against float64 CPU autograd (the code paths, to
    rounding), and float32 checkpointed against the same (loosely: ReLU kinks)."""
    import fastfold.ops.attention as attention

    want = _evo_grad_reference(ctx)
    plain, _, _ = _evo_train_grads(ctx, checkpoint=False, dtype=torch.float64)
    _compare_grads(fig, "f64 eager", plain, want, EVO_GRAD_F64_TOL)
    ckpt, _, _ = _evo_train_grads(ctx, checkpoint=True, dtype=torch.float64)
    _compare_grads(fig, "f64 ckpt", ckpt, want, EVO_GRAD_F64_TOL)
    saved = attention.EAGER_TRAINING_MAX_BYTES
    attention.EAGER_TRAINING_MAX_BYTES = 0  # [Note: eager attention in training]: the fused kernel
    try:
        fused, _, _ = _evo_train_grads(ctx, checkpoint=True, dtype=torch.float64)
        _compare_grads(fig, "f64 fused-attn", fused, want, EVO_GRAD_F64_TOL)
        _, t_fused, _ = _evo_train_grads(ctx, checkpoint=False)
    finally:
        attention.EAGER_TRAINING_MAX_BYTES = saved
    _, t_plain, peak_plain = _evo_train_grads(ctx, checkpoint=False)
    ckpt32, t_ckpt, peak_ckpt = _evo_train_grads(ctx, checkpoint=True)
    _compare_grads(fig, "f32 ckpt", ckpt32, want, EVO_GRAD_F32_TOL)
    fig.add(f"t f32 ckpt/plain {ratio(t_ckpt, t_plain)} fused/eager {ratio(t_fused, t_plain)}")
    fig.add(f"peak plain {mib(peak_plain)} ckpt {mib(peak_ckpt)}")


# ---------------------------------------------------------------------------------------------------
# 4. colossal.profiler
# ---------------------------------------------------------------------------------------------------


def _independent_model_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for state in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def check_profiler_step(ctx: Ctx, fig: Figures) -> None:
    """One profiled training step of the GPT on the device: phases, memory samples on the device
    tier (model bytes against an independent count, totals against the allocator), FLOPs against
    torch's FlopCounterMode on an identical step, output files; time against an unprofiled step."""
    from torch.utils.flop_counter import FlopCounterMode

    from colossal.profiler import Profiler

    setup = _gpt_setup(ctx)
    x, y = setup["x"].to(ctx.device), setup["y"].to(ctx.device)
    model = _build_gpt(setup).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=GPT_LR)

    def step():
        _criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: the end-of-step count includes them

    step()  # warm-up; allocates the optimizer state
    _, t_plain = timed(step, ctx.device)
    out_dir = os.path.join(ctx.tmp, "prof")
    with Profiler(model, opt, out_dir=out_dir, flops=True, tokens_per_step=x.numel()) as prof:
        _, t_prof = timed(step, ctx.device)
    allocated = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None
    with FlopCounterMode(display=False) as counter:
        _criterion(model(x), y).backward()
    _profiler_figures(ctx, fig, prof, model, opt, allocated, counter.get_total_flops())
    fig.expect("outputs written", bool(os.listdir(out_dir)), f"{len(os.listdir(out_dir))} files")
    fig.add(f"t profiled/plain {ratio(t_prof, t_plain)}")


def _profiler_figures(ctx: Ctx, fig: Figures, prof, model, opt, allocated: int | None, flops: int) -> None:
    rec = prof.steps[0]
    phases = {s.name for s in rec.spans if s.track == "phases"}
    fig.expect("phases", {"forward", "backward", "optimizer"} <= phases, ",".join(sorted(phases)))
    points = {p.label: p for p in rec.memory if p.source == "sampler"}
    tiers = {p.tier for p in rec.memory}
    fig.expect("device tier", str(ctx.device) in tiers or (not ctx.cuda and "cpu" in tiers), ",".join(sorted(tiers)))
    end = points.get("optimizer:end")
    fig.expect("optimizer:end sample", end is not None)
    if end is not None:
        fig.close("model bytes", abs(end.model_bytes - _independent_model_bytes(model, opt)) / end.model_bytes, 0.0)
        if allocated is not None:  # the sample's total is the allocator's count at that point
            fig.close("total vs allocator", abs(end.model_bytes + end.non_model_bytes - allocated) / allocated, 1e-2)
    fig.close("flops vs FlopCounterMode", abs((rec.flops or 0) - flops) / max(flops, 1), 0.0)
    fig.add(f"peak sampled {mib(prof.figures[0].peak_memory)}")


def check_profiler_gemini(ctx: Ctx, fig: Figures) -> None:
    """The profiler around a Gemini step under a small budget records Gemini's chunk moves and
    per-tier memory events (the colossal.gemini observer registry) and their byte total equals
    Gemini's own traffic count of that step."""
    from colossal.profiler import Profiler, Schedule
    from colossalai import Booster, GeminiPlugin

    setup = _gpt_setup(ctx)
    x, y = setup["x"].to(ctx.device), setup["y"].to(ctx.device)
    plugin = GeminiPlugin(placement="auto", device_memory_budget=gemini_budget(ctx))
    booster = Booster(plugin=plugin)
    model = _build_gpt(setup)
    model, opt, _, _, _ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=GPT_LR))

    def step():
        booster.backward(_criterion(model(x), y), opt)
        opt.step()
        opt.zero_grad()

    with Profiler(model, opt, schedule=Schedule(wait=1, active=1)) as prof:  # skip the warm-up step
        for _ in range(2):
            step()
            prof.step()
    rec = prof.steps[0]
    sources = {p.source for p in rec.memory}
    fig.expect("gemini memory events", "colossal.gemini" in sources, ",".join(sorted(sources)))
    moved = sum(m.nbytes for m in rec.moves)
    stats = plugin.model.stats
    counted = stats.bytes_to_device + stats.bytes_to_host
    fig.expect("chunk moves", bool(rec.moves), f"{len(rec.moves)} moves {mib(moved)}")
    fig.close("move bytes vs gemini stats", abs(moved - counted) / max(counted, 1), 0.0)


# ---------------------------------------------------------------------------------------------------
# 5. colossal.tensor_parallel and colossal.moe at world size 1
# ---------------------------------------------------------------------------------------------------


def _tp_compare(ctx: Ctx, fig: Figures, convert: Callable, loss_of: Callable, label: str) -> None:
    """Forward/backward of a converted GPT copy against the dense GPT on the device."""
    setup = _gpt_setup(ctx)
    x, y = setup["x"].to(ctx.device), setup["y"].to(ctx.device)
    dense = _build_gpt(setup).to(ctx.device)
    par = convert(copy.deepcopy(dense))
    _fwd_bwd(dense, x, y, lambda lg: _criterion(lg, y))  # warm-up
    loss_d, t_dense = timed(lambda: _fwd_bwd(dense, x, y, lambda lg: _criterion(lg, y)), ctx.device)
    _fwd_bwd(par, x, y, loss_of)
    loss_p, t_par = timed(lambda: _fwd_bwd(par, x, y, loss_of), ctx.device)
    fig.close(f"{label} loss", abs(loss_p - loss_d) / abs(loss_d), 1e-6)
    want = dict(dense.named_parameters())
    got = dict(par.named_parameters())
    names = [n for n in want if n in got]
    fig.expect(f"{label} same names", len(names) == len(want), f"{len(names)}/{len(want)}")
    fig.close(f"{label} grads", many_rel([got[n].grad for n in names], [want[n].grad for n in names]), 1e-5)
    fig.add(f"{label} t/dense {ratio(t_par, t_dense)}")


def _fwd_bwd(model, x, y, loss_of) -> float:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model(x))
    loss.backward()
    return float(loss.detach())


def check_tensor_parallel(ctx: Ctx, fig: Figures) -> None:
    """1D (Megatron) and sequence-parallel (ring and all-to-all attention) GPTs over a group of one
    against the dense GPT: losses and every parameter gradient."""
    from colossal.tensor_parallel import apply_1d, apply_sequence, cross_entropy_1d

    group, y = dist.group.WORLD, _gpt_setup(ctx)["y"].to(ctx.device)
    _tp_compare(ctx, fig, lambda m: apply_1d(m, group), lambda lg: cross_entropy_1d(lg, y, group), "1d")
    for kind in ("ring", "all_to_all"):
        convert = functools.partial(apply_sequence, group=group, kind=kind)
        _tp_compare(ctx, fig, convert, lambda lg: _criterion(lg, y), kind)


def check_moe(ctx: Ctx, fig: Figures) -> None:
    """An MoE layer (top-2, dropless and with capacity drops) on the device in float32 against its
    float64 CPU copy; bf16 experts (the grouped-matmul kernel) against float32; time against a
    dense MLP of the same FLOPs (top_k x ffn) in plain torch."""
    from colossal.moe import MoE, MoEConfig

    hidden, ffn, n_tok = (32, 64, 256) if ctx.quick else (128, 256, 2048)
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(n_tok, hidden, generator=gen, dtype=torch.float64)
    gy64 = torch.randn(n_tok, hidden, generator=gen, dtype=torch.float64)
    for cap in (None, 1.0):
        torch.manual_seed(0)
        cfg = MoEConfig(hidden=hidden, ffn_hidden=ffn, num_experts=8, top_k=2, capacity_factor=cap)
        moe = MoE(cfg).to(ctx.device)
        ref64 = copy.deepcopy(moe).cpu().double()  # before any forward: see the report (aux_loss)
        got = _moe_run(moe, x64.float().to(ctx.device), gy64.float().to(ctx.device))
        want = _moe_run(ref64, x64, gy64)
        fig.close(f"cap={cap} out", norm_rel(got[0], want[0]), 1e-5)
        fig.close(f"cap={cap} grads", many_rel(got[1], want[1]), 1e-5)
        fig.expect(f"cap={cap} same drops", got[2] == want[2], f"dropped {got[2]}")
    _moe_bf16(ctx, fig, cfg, x64, gy64)
    _moe_timing(ctx, fig, moe, x64.float().to(ctx.device), ffn * cfg.top_k)


def _moe_run(moe, x, gy) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Output, [input grad, parameter grads...] and the number of dropped assignments."""
    x = x.clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    y = moe(x)
    (y * gy).sum().backward()
    return y.detach(), [x.grad] + [p.grad for p in moe.parameters()], int(moe.stats.dropped)


def _moe_bf16(ctx: Ctx, fig: Figures, cfg, x64, gy64) -> None:
    """A bf16 layer against the float32 layer holding the same bf16-rounded weights, fed the same
    bf16-rounded input: the router computes its logits in float32 either way, so both route alike
    (with the float32 weights instead, near ties flip a few tokens to other experts)."""
    import colossal.moe.experts as experts
    from colossal.moe import MoE

    torch.manual_seed(0)
    low = MoE(dataclasses.replace(cfg, capacity_factor=None)).to(ctx.device, torch.bfloat16)
    ref_layer = MoE.from_dense(low, None).float()
    xb, gb = x64.to(ctx.device, torch.bfloat16), gy64.to(ctx.device, torch.bfloat16)
    ref = _moe_run(ref_layer, xb.float(), gb.float())
    got = _moe_run(low, xb, gb)
    # bf16 keeps 8 bits of mantissa: ~4e-3 per rounding, a few roundings deep
    fig.close("bf16 out vs fp32", norm_rel(got[0].float(), ref[0]), 2e-2)
    fig.close("bf16 grads vs fp32", many_rel([g.float() for g in got[1]], ref[1]), 2e-2)
    # which kernel ran (a private set, read for this figure only): torch._grouped_mm or the loop
    refused = sorted(f"{d}/{str(t).removeprefix('torch.')}" for d, t in getattr(experts, "_REFUSED", ()))
    fig.add(f"grouped_mm refused for {','.join(refused) or 'none'}")


def _moe_timing(ctx: Ctx, fig: Figures, moe, x: torch.Tensor, dense_ffn: int) -> None:
    hidden = x.shape[-1]
    mlp = torch.nn.Sequential(
        torch.nn.Linear(hidden, dense_ffn), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(dense_ffn, hidden)
    ).to(ctx.device)
    runs = []
    for module in (moe, mlp):
        module(x).sum().backward()  # warm-up
        runs.append(timed(lambda module=module: module(x).sum().backward(), ctx.device)[1])
    fig.add(f"fwd+bwd t/dense-MLP {ratio(runs[0], runs[1])}")


# ---------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------


def all_checks() -> list[tuple[str, Callable[[Ctx, Figures], None]]]:
    """Every check in run order (the plugin list imports colossalai: one FAIL line if it cannot)."""
    checks: list[tuple[str, Callable[[Ctx, Figures], None]]] = [
        ("optim.hybrid_adam", check_optim_hybrid_adam),
        ("optim.lamb", check_optim_lamb),
        ("optim.lars", check_optim_lars),
    ]
    try:
        plugins = _booster_plugins()
    except Exception:  # noqa: BLE001 - colossalai failed to import: one FAIL line says so
        plugins = [("booster", None)]
    for name, make in plugins:
        checks.append((name, functools.partial(_booster_check, make) if make else _import_failure))
    checks += [
        ("booster.gemini_bf16", check_booster_bf16),
        ("fastfold.forward_vs_f64", check_fastfold_forward),
        ("fastfold.chunked_inference", check_fastfold_chunked),
        ("fastfold.training_grads", check_fastfold_training),
        ("profiler.step", check_profiler_step),
        ("profiler.gemini_events", check_profiler_gemini),
        ("tensor_parallel.1d_sequence", check_tensor_parallel),
        ("moe.layer", check_moe),
    ]
    return checks


def _import_failure(ctx: Ctx, fig: Figures) -> None:
    import colossalai  # noqa: F401 - re-raises the import error with its traceback


def run_one(name: str, fn: Callable[[Ctx, Figures], None], ctx: Ctx, limit: int) -> bool:
    """Run one check, print its line; True when it passed."""
    fig = Figures()
    start = time.perf_counter()
    try:
        with soft_limit(limit):
            fn(ctx, fig)
        ok = not fig.failed
    except Exception:  # noqa: BLE001 - any failure of a check is reported and the next one runs
        traceback.print_exc()
        fig.add("exception (traceback above)")
        ok = False
    fig.add(f"[{time.perf_counter() - start:.1f}s]")
    print(f"{'PASS' if ok else 'FAIL'} {name}: {'; '.join(fig.parts)}", flush=True)
    free(ctx)
    return ok


def init_process_group(ctx: Ctx, fig: Figures) -> None:
    """A world of one: NCCL on CUDA, gloo on the CPU, rendezvous through a file; one all-reduce."""
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
    backend = "nccl" if ctx.cuda else "gloo"
    store = os.path.join(ctx.tmp, "rendezvous")
    start = time.perf_counter()
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    ones = torch.ones(4, device=ctx.device)
    dist.all_reduce(ones)  # NCCL creates its communicator at the first collective
    fig.expect("all_reduce", bool((ones == 1).all()), f"{backend} up in {time.perf_counter() - start:.1f}s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer elements")
    parser.add_argument("--only", default="", help="run the checks whose name contains this (comma list)")
    parser.add_argument("--time-limit", type=int, default=None, help="hard limit, s (cuda 230, cpu 1800)")
    parser.add_argument("--check-limit", type=int, default=None, help="soft limit per check, s (cuda 60, cpu 600)")
    return parser.parse_args(argv)


def resolve_device(args: argparse.Namespace) -> torch.device:
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA initialises: every package sees a CPU machine
        return torch.device("cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args)
    hard = args.time_limit or (230 if device.type == "cuda" else 1800)
    soft = args.check_limit or (60 if device.type == "cuda" else 600)
    faulthandler.dump_traceback_later(hard, exit=True)  # [Note: time limits]
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuda_check_") as tmp:
        ctx = Ctx(device=device, quick=args.quick, tmp=tmp)
        print(f"device {device}: {_describe(ctx)}", flush=True)
        wanted = [w for w in args.only.split(",") if w]
        failed = []
        for name, fn in [("process_group", init_process_group), *all_checks()]:
            if wanted and name != "process_group" and not any(w in name for w in wanted):
                continue
            if time.perf_counter() - begin > hard - 15:
                print(f"FAIL {name}: not run (time limit {hard}s nearly spent)", flush=True)
                failed.append(name)
            elif not run_one(name, fn, ctx, soft):
                failed.append(name)
        if dist.is_initialized():
            dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all passed'} [{time.perf_counter() - begin:.1f}s]")
    return 1 if failed else 0


def _describe(ctx: Ctx) -> str:
    text = f"torch {torch.__version__}, python {sys.version.split()[0]}"
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        text += f", {props.name} {props.total_memory / 2**30:.0f} GiB, cuda {torch.version.cuda}"
    else:
        text += f", {torch.get_num_threads()} threads"
    return text


if __name__ == "__main__":
    sys.exit(main())
