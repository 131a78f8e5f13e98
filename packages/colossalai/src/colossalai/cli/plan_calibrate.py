"""The engines' own host cost, measured for the planner (``colossalai plan --calibrate``).

The planner predicts operators and collectives; an engine also spends host time in its hooks and
bookkeeping (ZeRO's gradient hooks, stage 3's gathers, Gemini's chunk moves), which no operator
count shows. The planner may not import the engines (``ARCHITECTURE.md``, section 2), so the
meta-package measures them: each engine trains two tiny GPTs (1 and 4 blocks) on one process, and
the part of the step the planner's own model does not explain is fitted as ``per step + per
parameter tensor`` seconds (:attr:`colossal.planner.Coefficients.engine_overhead`).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from colossal.planner import Layout, predict_memory, predict_step_time, trace_model
from colossal.planner.trace import lm_loss
from colossalai.models import GPT, GPTConfig

__all__ = ["ENGINE_LAYOUTS", "build_engine", "engine_overheads"]

ENGINE_LAYOUTS = (
    Layout(engine="ddp"),
    Layout(engine="zero", zero_stage=1),
    Layout(engine="zero", zero_stage=2),
    Layout(engine="zero", zero_stage=3),
    Layout(engine="zero", zero_stage=1, offload=True),
    Layout(engine="zero", zero_stage=2, offload=True),
    Layout(engine="zero", zero_stage=3, offload=True),
    Layout(engine="gemini", placement="static", device_budget=256 << 20),
    Layout(engine="gemini", placement="auto", device_budget=256 << 20),
)
"""The engines calibrated (one layout per :attr:`Layout.engine_key`)."""


def build_engine(model: torch.nn.Module, layout: Layout, disk_dir: str | None = None):
    """``(module, step)`` running ``layout`` on ``model`` with AdamW: ``step(x)`` runs one training
    step on token ids ``x`` (forward, loss, backward, optimizer step, zero_grad)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if layout.engine == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=True, bucket_cap_mb=layout.ddp_bucket_cap_mb
        )

        def step(x):
            lm_loss(module(x), x).backward()
            opt.step()
            opt.zero_grad()

        return module, step
    if layout.engine == "zero":
        from colossal.zero import ZeroOptimizer

        zero = ZeroOptimizer(opt, model, stage=layout.zero_stage, offload=layout.offload, param_dtype=layout.precision,
                             bucket_numel=layout.bucket_numel)  # fmt: skip

        def step(x):
            lm_loss(model(x), x).backward()
            zero.step()
            zero.zero_grad()

        return model, step
    if layout.engine == "hybrid":
        return _hybrid_engine(model, opt, layout)
    from colossal.gemini import GeminiDDP, GeminiOptimizer

    kw = dict(placement=layout.placement, device_memory_budget=layout.device_budget, chunk_size=layout.chunk_size,
              mixed_precision=None if layout.precision == torch.float32 else layout.precision,
              offload_param_frac=layout.offload_param_frac, offload_optim_frac=layout.offload_optim_frac,
              keep_gathered=layout.keep_gathered)  # fmt: skip
    if layout.disk:
        kw.update(disk_dir=disk_dir, host_memory_budget=layout.host_budget)
    gem = GeminiDDP(model, **kw)
    gopt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-3), gem)

    def step(x):
        gopt.backward(lm_loss(gem(x), x))
        gopt.step()
        gopt.zero_grad()

    return gem, step


def _hybrid_engine(model: torch.nn.Module, opt, layout: Layout):
    """``HybridParallelPlugin`` with ``layout``'s degrees, through the Booster (fp32 weights, the
    layout's precision as autocast)."""
    from colossalai.booster import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=layout.tp, tp_mode=layout.tp_mode, tp_depth=layout.tp_depth,
                                  sp_size=layout.sp, sp_kind=layout.sp_kind, zero_stage=layout.zero_stage,
                                  pp_size=layout.pp, num_microbatches=layout.microbatches,
                                  pp_schedule=layout.pp_schedule, pp_virtual=layout.pp_virtual,
                                  ep_size=layout.ep)  # fmt: skip
    booster = Booster(plugin=plugin, mixed_precision=layout.precision_name)
    module, optim, *_ = booster.boost(model, opt)

    def step(x):
        if layout.pp > 1:
            booster.execute_pipeline((x, x), module, lambda out, y: lm_loss(out, y), optim)
        else:
            booster.backward(lm_loss(module(x), x), optim)
        optim.step()
        optim.zero_grad()

    return module, step


def _timed_step(layout: Layout, cfg: GPTConfig, batch: int, seq: int, reps: int) -> float:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="colossal-calibrate-") as disk_dir:
        _, step = build_engine(GPT(cfg), layout, disk_dir)
        x = torch.randint(0, cfg.vocab_size, (batch, seq))
        for _ in range(3):  # Gemini traces and places in its first steps
            step(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_overheads(hardware, op_overhead: float, *, reps: int = 7) -> dict[str, tuple[float, float]]:
    """``Layout.engine_key -> (seconds per step, seconds per parameter tensor)`` on this machine.

    Needs a process group (one rank: ``colossal.comm.ensure_process_group``). Takes a few seconds
    per engine on a CPU.
    """
    import colossal.comm as cc

    cc.ensure_process_group("colossalai plan --calibrate")
    batch, seq = 2, 32
    out = {}
    for layout in ENGINE_LAYOUTS:
        points = []
        for n_layer in (1, 4):
            cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=128, block_size=seq)
            measured = _timed_step(layout, cfg, batch, seq, reps)
            trace = trace_model(lambda cfg=cfg: GPT(cfg), batch=batch, seq=seq, dtype=layout.precision)
            mem = predict_memory(trace, layout, device_type=hardware.device_type, device_memory=hardware.device_memory)
            want = predict_step_time(trace, layout, hardware, op_overhead=op_overhead,
                                     n_step_tensors=mem.breakdown.get("optimizer_tensors", 1)).total  # fmt: skip
            points.append((len(trace.params), measured - want))
        (n1, r1), (n2, r2) = points
        per_tensor = max(0.0, (r2 - r1) / (n2 - n1))
        out[layout.engine_key] = (max(0.0, r1 - per_tensor * n1), per_tensor)
    return out
