"""``plan()``: every layout the stack can run for a model on some hardware, ranked.

For each layout: the per-rank peak bytes per tier (:mod:`colossal.planner.memory`), whether it fits
(and if not, what it needs against what the hardware has), the bytes communicated per step, the
predicted step time, tokens/s and MFU (:mod:`colossal.planner.speed`), and the ``colossalai
train`` command and Booster code that run it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from colossal.comm import as_dtype
from colossal.planner.hardware import Hardware
from colossal.planner.hybrid import model_flops
from colossal.planner.layout import Layout, TierBytes
from colossal.planner.memory import MemoryPrediction, predict_memory
from colossal.planner.speed import StepTime, comm_bytes, predict_step_time
from colossal.planner.trace import ModelTrace, trace_model

__all__ = ["Candidate", "plan", "candidate_layouts", "hybrid_layouts", "format_bytes"]


def format_bytes(n: float) -> str:
    """``31.2 GiB``-style bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One layout's prediction."""

    layout: Layout
    """The layout."""
    memory: MemoryPrediction
    """Peak bytes per tier of one rank, with the breakdown."""
    fits: bool
    """Whether every tier is within the hardware."""
    shortfalls: tuple[str, ...]
    """For a layout that does not fit: ``"needs 31.2 GiB on the device, has 24.0 GiB"`` per tier."""
    comm: dict[str, int]
    """Message bytes per collective per step of one rank."""
    time: StepTime
    """Predicted step time by part."""
    tokens_per_second: float
    """Global tokens per second."""
    mfu: float
    """Model FLOPs (``6 * params * tokens``, plus attention, from the trace's forward x 3) over the
    hardware's peak FLOP/s of all ranks, for the step time."""
    runnable: bool = True
    """False when the engine cannot run the model at all (its reason is the only shortfall; the
    figures are zero)."""

    @property
    def tiers(self) -> TierBytes:
        """Shortcut for ``memory.tiers``."""
        return self.memory.tiers

    checkpointing: bool = False
    """Whether the prediction assumed activation checkpointing (the command and code say so)."""
    nodes: int = 1
    """Nodes the layout spans (``colossalai train`` launches on one)."""

    @property
    def device_budget(self) -> int | None:
        """The device budget Gemini was planned with (its own budget, else the device's memory)."""
        return self.memory.breakdown.get("budget") if self.layout.engine == "gemini" else None

    def command(self, model_flags: str, batch: int, seq: int) -> str | None:
        """A ``colossalai train`` command line running this layout (``model_flags``: the model's own,
        e.g. ``"--model gpt --preset 1.3b"``), or ``None`` where the command line cannot say it: a
        layout over several nodes, or Gemini's static placement with optimizer states on the device
        (``offload_optim_frac`` has no flag; :meth:`booster_code` sets it)."""
        lay = self.layout
        if self.nodes > 1 or (lay.engine == "gemini" and (lay.offload_optim_frac != 1.0 or lay.offload_param_frac)):
            return None
        if lay.engine == "hybrid" and lay.zero_stage:  # --zero-stage is the zero plugin's
            return None
        parts = ["colossalai train", f"--nproc {lay.world}", f"{model_flags}", f"--plugin {lay.engine}",
                 f"--batch-size {batch}", f"--seq-len {seq}", f"--precision {lay.precision_name}",
                 "--activation-checkpointing" if self.checkpointing else "--no-activation-checkpointing"]  # fmt: skip
        if lay.engine == "zero":
            parts.append(f"--zero-stage {lay.zero_stage}")
            if lay.offload:
                parts.append("--offload")
        if lay.engine == "hybrid":
            parts.append(f"--tp-size {lay.tp} --tp-mode {lay.tp_mode}")
            if lay.tp_depth > 1:
                parts.append(f"--tp-depth {lay.tp_depth}")
            if lay.sp > 1:
                parts.append(f"--sp-size {lay.sp} --sp-kind {lay.sp_kind}")
            if lay.pp > 1:
                parts.append(f"--pp-size {lay.pp} --microbatches {lay.microbatches} --pp-schedule {lay.pp_schedule}")
                if lay.pp_virtual > 1:
                    parts.append(f"--pp-virtual {lay.pp_virtual}")
            if lay.ep > 1:
                parts.append(f"--ep-size {lay.ep}")
        if lay.engine == "gemini":
            parts.append(f"--placement {lay.placement}")
            if self.device_budget:
                parts.append(f"--device-budget {self.device_budget}")
            if lay.disk:
                parts.append("--disk-dir /path/to/fast/disk")
                if lay.host_budget is not None:
                    parts.append(f"--host-budget {lay.host_budget}")
        return " ".join(parts)

    def booster_code(self) -> str:
        """The Booster lines that run this layout on the user's own model."""
        lay = self.layout
        if lay.engine == "ddp":
            plugin = "TorchDDPPlugin()"
        elif lay.engine == "zero":
            plugin = f"ZeroPlugin(stage={lay.zero_stage}, offload={lay.offload})"
        elif lay.engine == "hybrid":
            args = [f"tp_size={lay.tp}", f'tp_mode="{lay.tp_mode}"']
            if lay.tp_depth > 1:
                args.append(f"tp_depth={lay.tp_depth}")
            if lay.sp > 1:
                args += [f"sp_size={lay.sp}", f'sp_kind="{lay.sp_kind}"']
            if lay.pp > 1:
                args += [
                    f"pp_size={lay.pp}",
                    f"num_microbatches={lay.microbatches}",
                    f'pp_schedule="{lay.pp_schedule}"',
                ]
                if lay.pp_virtual > 1:
                    args.append(f"pp_virtual={lay.pp_virtual}")
            if lay.ep > 1:
                args.append(f"ep_size={lay.ep}")
            if lay.zero_stage:
                args.append(f"zero_stage={lay.zero_stage}")
            plugin = f"HybridParallelPlugin({', '.join(args)})"
        else:
            args = [f'placement="{lay.placement}"']
            if self.device_budget:
                args.append(f"device_memory_budget={self.device_budget}")
            if lay.placement == "static":
                args.append(f"offload_optim_frac={lay.offload_optim_frac}")
                if lay.offload_param_frac:
                    args.append(f"offload_param_frac={lay.offload_param_frac}")
            if lay.disk:
                args.append('disk_dir="/path/to/fast/disk"')
                if lay.host_budget is not None:
                    args.append(f"host_memory_budget={lay.host_budget}")
            plugin = f"GeminiPlugin({', '.join(args)})"
        lines = ["from colossalai.booster import Booster, " + plugin.split("(")[0]]
        if self.checkpointing:
            lines.append("# planned with activation checkpointing: model.set_activation_checkpointing(True), or")
            lines.append("# model.gradient_checkpointing_enable() on a Hugging Face model")
        lines.append(f'booster = Booster(plugin={plugin}, mixed_precision="{lay.precision_name}")')
        lines.append(
            "model, optimizer, criterion, dataloader, _ = booster.boost(model, optimizer, criterion, dataloader)"
        )
        if lay.engine == "hybrid" and lay.pp > 1:
            lines.append("# each step: loss = booster.execute_pipeline((x, y), model, criterion, optimizer)")
        return "\n".join(lines)


def candidate_layouts(
    world: int, precision: torch.dtype, *, disk: bool = True, host_budget: int | None = None
) -> list[Layout]:
    """Every data-parallel layout of the stack on ``world`` ranks: DDP; ZeRO 1/2/3 with and without
    offload; Gemini static (optimizer states on the device, or on the host) and auto, with and
    without the disk tier (given ``host_budget`` bytes of host memory per rank)."""
    out = [Layout(engine="ddp", dp=world, precision=torch.float32)]
    for stage in (1, 2, 3):
        for offload in (False, True):
            out.append(Layout(engine="zero", dp=world, zero_stage=stage, offload=offload, precision=precision))
    out.append(Layout(engine="gemini", dp=world, placement="static", offload_optim_frac=0.0, precision=precision))
    out.append(Layout(engine="gemini", dp=world, placement="static", offload_optim_frac=1.0, precision=precision))
    out.append(Layout(engine="gemini", dp=world, placement="auto", precision=precision))
    if disk:
        out.append(Layout(engine="gemini", dp=world, placement="auto", disk=True, host_budget=host_budget or 2**30,
                          precision=precision))  # fmt: skip
    return out


def hybrid_layouts(
    world: int, precision: torch.dtype, *, devices_per_node: int, batch: int, n_blocks: int, heads: int = 0
) -> list[Layout]:
    """Hybrid candidates on ``world`` ranks: 1D tensor parallelism inside a node (``tp`` a power of two
    dividing the heads), pipelines of ``pp`` stages over the blocks (1F1B, as many micro-batches as
    each data-parallel rank has sequences, up to ``4 pp``), data parallelism over the rest, DDP and ZeRO-1."""
    out = []
    tps = [t for t in (2, 4, 8) if t <= devices_per_node and world % t == 0 and (not heads or heads % t == 0)]
    for tp in [1, *tps]:
        for pp in (1, 2, 4, 8, 16):
            if world % (tp * pp) or (pp > 1 and (n_blocks % pp or n_blocks < pp)) or tp * pp == 1:
                continue
            dp = world // (tp * pp)
            if batch % dp:
                continue
            per_rank = batch // dp
            m = 1
            if pp > 1:
                m = max((d for d in range(1, min(per_rank, 4 * pp) + 1) if per_rank % d == 0), default=1)
            for zero in (0, 1):
                if zero and (dp == 1 or precision == torch.float16):  # the plugin runs no fp16 ZeRO
                    continue
                out.append(Layout(engine="hybrid", dp=dp, tp=tp, pp=pp, microbatches=m, zero_stage=zero,
                                  precision=precision))  # fmt: skip
    return out


def _hybrid_candidates(model, world, precision, hardware, batch, seq, trace_kwargs) -> list[Layout]:
    """:func:`hybrid_layouts` for a model of blocks (an ``nn.ModuleList``) with attention heads, each
    checked against the model (one small trace tells its blocks, heads and widths); none for a model
    the trace cannot take at a short length, or without blocks."""
    from colossal.planner.hybrid import check_hybrid

    try:
        probe = trace_model(model, batch=1, seq=min(seq, 16), dtype=precision, device_type=hardware.device_type,
                            **(trace_kwargs or {}))  # fmt: skip
    except Exception:  # noqa: BLE001 (a model that needs its own length or inputs: no hybrid candidates)
        return []
    if not probe.blocks or not probe.heads:
        return []
    out = []
    for lay in hybrid_layouts(world, precision, devices_per_node=hardware.devices_per_node, batch=batch,
                              n_blocks=len(probe.blocks), heads=probe.heads):  # fmt: skip
        try:
            check_hybrid(probe, lay)
        except ValueError:
            continue
        out.append(lay)
    return out


def _shortfalls(mem: MemoryPrediction, hw: Hardware, ranks_per_node: int) -> list[str]:
    tiers, out = mem.tiers, []
    if hw.device_type == "cpu":  # device and host tiers are one RAM: their peak together must fit
        combined = mem.breakdown.get("combined", tiers.device + tiers.host_total) * ranks_per_node
        if combined > hw.host_memory:
            out.append(
                f"needs {format_bytes(combined)} of RAM per node (device and host tiers share it), "
                f"has {format_bytes(hw.host_memory)}"
            )
    if tiers.device > hw.device_memory:
        out.append(f"needs {format_bytes(tiers.device)} on the device, has {format_bytes(hw.device_memory)}")
    host = tiers.host_total * ranks_per_node
    if host > hw.host_memory:
        out.append(f"needs {format_bytes(host)} of host memory per node, has {format_bytes(hw.host_memory)}")
    if tiers.pinned_host * ranks_per_node > hw.pinnable_host_memory:
        out.append(
            f"needs {format_bytes(tiers.pinned_host * ranks_per_node)} of pinned host memory per node, "
            f"has {format_bytes(hw.pinnable_host_memory)}"
        )
    if tiers.disk * ranks_per_node > hw.disk_free:
        out.append(
            f"needs {format_bytes(tiers.disk * ranks_per_node)} of disk per node, has {format_bytes(hw.disk_free)}"
        )
    return out


def plan(
    model: Callable[[], nn.Module] | ModelTrace | dict[torch.dtype, ModelTrace],
    *,
    batch: int,
    seq: int,
    hardware: Hardware,
    precision: torch.dtype | str = torch.bfloat16,
    activation_checkpointing: bool = False,
    layouts: Sequence[Layout] | None = None,
    op_overhead: float | dict[str, float] | None = None,
    engine_overhead: dict[str, tuple[float, float]] | None = None,
    trace_kwargs: dict | None = None,
) -> list[Candidate]:
    """Predict every layout (default :func:`candidate_layouts` over all of ``hardware``'s devices,
    and for a model factory on several devices :func:`hybrid_layouts`)
    for ``model`` (a factory built on the meta device, or ready traces) at global ``batch`` sequences
    of ``seq`` tokens; returns those that fit first, fastest first, then the rest by how far over
    they are. ``op_overhead`` and ``engine_overhead`` are the calibration's
    (:class:`~colossal.planner.Coefficients`): host seconds per operator and per engine."""
    precision = as_dtype(precision)
    world = hardware.world_size
    if layouts is None:
        one_trace = isinstance(model, ModelTrace)
        if one_trace:  # every layout in the trace's precision
            precision = model.dtype
        # the disk tier's layout keeps half of each rank's share of the host RAM for Gemini
        layouts = candidate_layouts(
            world, precision, host_budget=hardware.host_memory // hardware.devices_per_node // 2
        )
        if one_trace and precision != torch.float32:  # the DDP layout is the fp32 step
            layouts = [lay for lay in layouts if lay.engine != "ddp"]
        if callable(model) and not isinstance(model, ModelTrace | dict) and world > 1:
            layouts += _hybrid_candidates(model, world, precision, hardware, batch, seq, trace_kwargs)
    for lay in layouts:
        if lay.world > world:
            raise ValueError(f"{lay.label} needs {lay.world} ranks, {hardware.name} has {world} devices")
        m = lay.microbatches if lay.engine == "hybrid" else 1
        if batch % (lay.dp * m):
            raise ValueError(
                f"batch={batch} is not divisible by the {lay.dp} data-parallel ranks x {m} micro-batches of {lay.label}"
            )
        if seq % lay.sp:
            raise ValueError(f"seq={seq} is not divisible by the {lay.sp} sequence-parallel ranks of {lay.label}")
    traces: dict[tuple[torch.dtype, int, int], ModelTrace] = {}

    def given(trace: ModelTrace, dtype: torch.dtype, micro: int, tokens: int) -> ModelTrace:
        if (trace.batch, trace.seq, trace.dtype) != (micro, tokens, dtype):
            raise ValueError(
                f"the trace given is of batch={trace.batch}, seq={trace.seq}, dtype={trace.dtype}; this layout "
                f"needs batch={micro} (the micro-batch of one rank), seq={tokens} (its sequence chunk), dtype={dtype}"
            )
        return trace

    def trace_for(dtype: torch.dtype, micro: int, tokens: int) -> ModelTrace:
        if isinstance(model, ModelTrace):
            return given(model, dtype, micro, tokens)
        if isinstance(model, dict):
            if dtype not in model:
                raise ValueError(f"no trace for dtype {dtype} among the traces given ({sorted(map(str, model))})")
            return given(model[dtype], dtype, micro, tokens)
        key = (dtype, micro, tokens)
        if key not in traces:
            traces[key] = trace_model(
                model,
                batch=micro,
                seq=tokens,
                dtype=dtype,
                device_type=hardware.device_type,
                activation_checkpointing=activation_checkpointing,
                **(trace_kwargs or {}),
            )
        return traces[key]

    default = 1e-5 if hardware.device_type == "cuda" else 5e-6

    def overhead_for(dtype: torch.dtype) -> float:  # a dict: per dtype name (Coefficients.op_overhead_by_dtype)
        if isinstance(op_overhead, dict):
            return op_overhead.get(str(dtype).removeprefix("torch."), op_overhead.get("float32", default))
        return default if op_overhead is None else op_overhead

    out = []
    for lay in layouts:
        hybrid = lay.engine == "hybrid"
        trace = trace_for(lay.precision, batch // lay.dp // (lay.microbatches if hybrid else 1), seq // lay.sp)
        try:
            mem = predict_memory(trace, lay, device_type=hardware.device_type, device_memory=hardware.device_memory)
        except NotImplementedError as exc:  # the engine refuses this layout (e.g. Gemini's disk tier kept gathered)
            none = MemoryPrediction(TierBytes(device=0), {})
            none_t = StepTime(0.0, 0.0, 0.0, 0.0)
            out.append(Candidate(lay, none, False, (str(exc),), {}, none_t, 0.0, 0.0, runnable=False))
            continue
        moved = mem.breakdown.get("bytes_moved_per_step", 0)
        disk = (mem.breakdown.get("disk_read_per_step", 0), mem.breakdown.get("disk_written_per_step", 0))
        t = predict_step_time(
            trace,
            lay,
            hardware,
            op_overhead=overhead_for(lay.precision),
            moved_bytes=moved,
            disk_bytes=disk,
            n_step_tensors=mem.breakdown.get("optimizer_tensors", 1),
            engine_overhead=(engine_overhead or {}).get(lay.engine_key, (0.0, 0.0)),
            host_fraction=mem.breakdown.get("optimizer_host_permille", 0) / 1000,
        )
        short = _shortfalls(mem, hardware, min(lay.world, hardware.devices_per_node))
        comm = comm_bytes(trace, lay, mem.breakdown.get("optimizer_tensors", 1))
        tokens = batch * seq / t.total
        # forward + backward (2x) of the whole global batch, without recomputation
        mfu = model_flops(trace, lay, batch) / t.total / (hardware.flops(lay.precision) * lay.world)
        out.append(
            Candidate(
                lay,
                mem,
                not short,
                tuple(short),
                comm,
                t,
                tokens,
                mfu,
                checkpointing=activation_checkpointing,
                nodes=-(-lay.world // hardware.devices_per_node),
            )
        )
    fit = sorted((c for c in out if c.fits), key=lambda c: c.time.total)

    def over(c: Candidate) -> float:  # the worst tier's need over what the hardware has
        t, per_node = c.tiers, min(c.layout.world, hardware.devices_per_node)
        return max(t.device / hardware.device_memory, t.host_total * per_node / hardware.host_memory)

    unfit = sorted((c for c in out if not c.fits and c.runnable), key=over)
    return fit + unfit + [c for c in out if not c.runnable]
