"""Step time of a layout: a roofline of the traced operators plus alpha-beta communication.

* **Compute:** each operator of the trace takes ``max(flops / rate, io_bytes / memory_bandwidth)``,
  ``rate`` the FLOP/s a matmul of that many FLOPs reaches (:meth:`Hardware.matmul_rate`: the
  calibrated curve, else the peak), plus the host's cost of dispatching one operator (``op_overhead``, measured by
  ``colossalai plan --calibrate``; it dominates small models on a CPU).
* **Optimizer step:** element-wise over this rank's share of the masters: Adam reads the parameter,
  its gradient and two moments and writes three of them (7 fp32 accesses per element), on the
  device, or on the host for ZeRO-Offload (at the host's copy bandwidth).
* **Communication:** ``alpha + nbytes * algbw_factor / bandwidth`` per collective, with the ring
  factors of nccl-tests (all-reduce ``2 (n - 1) / n``, all-gather and reduce-scatter ``(n - 1) / n``);
  inside a node the intra-node bandwidth, across nodes the inter-node one.
* **Tier copies:** bytes moved between device and host at the host-link bandwidth, to and from the
  disk at its read and write bandwidths.
* **Overlap:** on CUDA gradient reductions run on their own stream during backward, so only the
  part longer than the backward's compute adds to the step; on a CPU with gloo the collectives take
  the same cores as compute, and nothing overlaps.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from colossal.planner.hardware import Hardware
from colossal.planner.hybrid import check_hybrid, hybrid_comm_calls, rank_step
from colossal.planner.layout import Layout
from colossal.planner.trace import ModelTrace

__all__ = ["StepTime", "predict_step_time", "comm_bytes", "comm_calls", "hybrid_step_time", "hybrid_comm_bytes"]

_ADAM_ACCESSES = 7  # fp32 reads: param, grad, exp_avg, exp_avg_sq; writes: param, exp_avg, exp_avg_sq
_ADAM_OPS_PER_TENSOR = (
    10  # torch's single-tensor AdamW: step += 1, mul_, lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_ ...
)
_ADAM_FOREACH_OPS = 12  # the same as foreach ops over every tensor of a dtype at once (CUDA)


@dataclasses.dataclass(frozen=True, slots=True)
class StepTime:
    """Predicted seconds of one step, by part."""

    compute: float
    """Forward + backward operators (roofline + dispatch)."""
    optimizer: float
    """The optimizer step over this rank's shard."""
    comm: float
    """Collectives not hidden behind compute."""
    copies: float
    """Device<->host and disk traffic."""

    @property
    def total(self) -> float:
        """The step."""
        return self.compute + self.optimizer + self.comm + self.copies


def comm_calls(trace: ModelTrace, layout: Layout, buffers: int = 1) -> list[tuple[str, int]]:
    """The collectives one rank issues per step, as ``(op, message bytes)`` (nccl-tests convention:
    the full buffer of an all-reduce, the gathered output of an all-gather, the input of a
    reduce-scatter). ``buffers``: the engine's flat buffers (ZeRO's buckets or units, Gemini's
    chunks), each reduced and gathered on its own.

    Besides the gradients and parameters, ZeRO agrees on overflow (a 4-byte all-reduce) and on which
    parameters got a gradient (one byte per parameter); DDP and Gemini issue one call per bucket or
    chunk."""
    n = layout.dp
    if layout.engine == "hybrid":
        raise ValueError("comm_calls takes a data-parallel layout; a hybrid layout's are colossal.planner.hybrid's")
    if n == 1:
        return []
    w = layout.precision.itemsize
    trainable = [p for p in trace.params if p.requires_grad]
    grads = sum(p.numel for p in trainable) * w
    params = trace.numel * w
    if layout.engine == "ddp":
        cap = layout.ddp_bucket_cap_mb << 20
        k = max(1, -(-grads // cap))
        return [("all_reduce", grads // k)] * k
    k = max(1, buffers)
    if layout.engine == "zero":
        gathers = 2 * k - 1 if layout.zero_stage == 3 else k  # stage 3: forward and backward, the root once
        calls = [("reduce_scatter", grads // k)] * k + [("all_gather", params // k)] * gathers
        return calls + [("all_reduce", 4), ("all_reduce", len(trainable))]
    if layout.keep_gathered:
        return [("all_reduce", grads // k)] * k
    return [("reduce_scatter", grads // k)] * k + [("all_gather", params // k)] * (2 * k)


def comm_bytes(trace: ModelTrace, layout: Layout, buffers: int = 1) -> dict[str, int]:
    """Message bytes per collective per step of one rank (:func:`comm_calls`, summed per op; a
    hybrid layout's keyed by group, :func:`colossal.planner.hybrid.hybrid_comm_bytes`)."""
    if layout.engine == "hybrid":
        return hybrid_comm_bytes(trace, layout, buffers)
    out: dict[str, int] = {}
    for op, nbytes in comm_calls(trace, layout, buffers):
        out[op] = out.get(op, 0) + nbytes
    return out


_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
           "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}  # fmt: skip


def predict_step_time(
    trace: ModelTrace,
    layout: Layout,
    hardware: Hardware,
    *,
    op_overhead: float = 1e-5,
    moved_bytes: int = 0,
    disk_bytes: tuple[int, int] = (0, 0),
    n_step_tensors: int = 1,
    engine_overhead: tuple[float, float] = (0.0, 0.0),
    host_fraction: float = 0.0,
) -> StepTime:
    """Seconds of one step of ``layout`` (see the module docstring). ``moved_bytes`` are the
    device<->host bytes per step and ``disk_bytes`` the (read, written) disk bytes, from the
    memory prediction (Gemini under pressure, ZeRO-Offload); ``n_step_tensors`` the tensors a
    sharded engine hands its optimizer (ZeRO's flats, Gemini's chunks); ``engine_overhead`` the
    engine's host seconds ``(per step, per parameter tensor)`` from the calibration; ``host_fraction``
    the part of the optimizer step a sharded engine runs on the host (Gemini's offloaded blocks)."""
    if layout.engine == "hybrid":
        return hybrid_step_time(trace, layout, hardware, op_overhead=op_overhead, n_step_tensors=n_step_tensors,
                                engine_overhead=engine_overhead)  # fmt: skip
    bw = hardware.memory_bandwidth
    rate = functools.lru_cache(maxsize=None)(lambda f: hardware.matmul_rate(layout.precision, f))
    attn = functools.lru_cache(maxsize=None)(lambda f: hardware.attention_rate(layout.precision, f))
    per_op = [
        max((f / (attn(f) if a else rate(f))) if f else 0.0, b / bw)
        for f, b, a in zip(trace.flops, trace.io_bytes, trace.attention, strict=True)
    ]
    compute = sum(per_op) + trace.ops * op_overhead
    compute += engine_overhead[0] + engine_overhead[1] * len(trace.params)
    backward = sum(per_op[trace.backward_start :])
    trainable = sum(p.numel for p in trace.params if p.requires_grad)
    share = trainable if layout.engine == "ddp" else -(-trainable // layout.dp)
    offloaded = layout.engine == "zero" and layout.offload
    on_host = 1.0 if offloaded else host_fraction  # of the optimizer step, run by the CPU
    step_bw = 1.0 / ((1.0 - on_host) / bw + on_host / hardware.host_link_bandwidth)
    optimizer = share * _ADAM_ACCESSES * 4 / step_bw * (layout.states > 0)
    # the optimizer's host cost: one loop over the tensors it steps (the parameters under DDP, the
    # flat shards under ZeRO, one per chunk under Gemini), foreach on CUDA unless offloaded
    tensors = sum(p.requires_grad for p in trace.params) if layout.engine == "ddp" else max(1, n_step_tensors)
    foreach = hardware.device_type == "cuda" and not offloaded
    optimizer += (_ADAM_FOREACH_OPS if foreach else _ADAM_OPS_PER_TENSOR * tensors) * op_overhead
    comm = 0.0
    n = layout.dp
    inter = hardware.nodes > 1 and n > hardware.devices_per_node
    link = hardware.inter_node_bandwidth if inter else hardware.intra_node_bandwidth
    alpha = hardware.inter_node_latency if inter else hardware.link_latency
    reductions = 0.0  # gradient reductions: these overlap backward on CUDA
    for op, nbytes in comm_calls(trace, layout, n_step_tensors):
        t = alpha + nbytes * _FACTOR[op](n) / link
        if op in ("all_reduce", "reduce_scatter"):
            reductions += t
        else:
            comm += t
    comm += max(0.0, reductions - backward) if hardware.device_type == "cuda" else reductions
    copies = 0.0
    if layout.engine == "zero" and layout.offload:
        w = layout.precision.itemsize
        moved_bytes += share * (w + w)  # gradients down, updated parameters up
    copies += moved_bytes / hardware.host_link_bandwidth
    copies += disk_bytes[0] / hardware.disk_read_bandwidth + disk_bytes[1] / hardware.disk_write_bandwidth
    return StepTime(compute=compute, optimizer=optimizer, comm=comm, copies=copies)


def _group_link(hardware, layout: Layout, axis: str) -> tuple[float, float]:
    """(bandwidth, latency) of ``axis``'s group: the mesh is ``pp, dp, sp, tp`` (tp innermost), so a
    group stays inside a node while the product of its axis and the axes inside it fits one."""
    inner = {"tp": layout.tp, "sp": layout.sp * layout.tp, "ep": layout.ep * layout.sp * layout.tp,
             "dp": layout.dp * layout.sp * layout.tp, "pp": layout.world}[axis]  # fmt: skip
    if hardware.nodes > 1 and inner > hardware.devices_per_node:
        return hardware.inter_node_bandwidth, hardware.inter_node_latency
    return hardware.intra_node_bandwidth, hardware.link_latency


def hybrid_step_time(trace: ModelTrace, layout: Layout, hardware, *, op_overhead: float, n_step_tensors: int = 1,
                     engine_overhead: tuple[float, float] = (0.0, 0.0)):  # fmt: skip
    """Seconds of one step of the slowest pipeline rank (a :class:`~colossal.planner.StepTime`)."""
    check_hybrid(trace, layout)
    bw = hardware.memory_bandwidth
    tp, one_d = layout.tp, layout.tp_mode == "1d"
    m = layout.microbatches
    worst = None
    for r in range(layout.pp):
        st = rank_step(trace, layout, r)
        per_mb = 0.0
        for j in st.compute_ops:
            f, b, a = trace.flops[j], trace.io_bytes[j], trace.attention[j]
            if layout.sp > 1 and a:
                f *= layout.sp  # each query chunk attends to the whole sequence
            # split work: 1D's split operators, 2D/2.5D/3D's whole blocks, and the vocabulary-parallel
            # LM head (the matmuls outside the blocks)
            if tp > 1 and (
                (trace.split[j] if one_d else trace.in_block[j]) or (f and trace.vocab and not trace.in_block[j])
            ):
                f, b = f / tp, b / tp
            rate = hardware.attention_rate(layout.precision, f) if a else hardware.matmul_rate(layout.precision, f)
            per_mb += max(f / rate if f else 0.0, b / bw) + op_overhead
        backward = per_mb * (1 - st.trace.backward_start / max(1, len(st.compute_ops)))
        crit = 0.0  # collectives on the critical path, per step
        for op, nbytes, axis in hybrid_comm_calls(trace, layout, st):
            n = {"tp": tp, "sp": layout.sp, "pp": 2, "ep": layout.ep}[axis]
            link, alpha = _group_link(hardware, layout, axis)
            crit += alpha + nbytes * _FACTOR[op](n) / link
        group = layout.dp * layout.sp
        inner = _dp_layout(layout)
        link, alpha = _group_link(hardware, layout, "dp")
        reductions = sum(
            alpha + nb * _FACTOR[op](group) / link for op, nb in comm_calls(st.trace, inner, n_step_tensors)
        )
        overlap = hardware.device_type == "cuda" and layout.pp == 1
        dp_comm = max(0.0, reductions - backward * m) if overlap else reductions
        bubble = {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 1 / layout.pp_virtual, "zero_bubble": 1 / 3}[
            layout.pp_schedule
        ] * (layout.pp - 1)
        compute = per_mb * (m + bubble) + engine_overhead[0] + engine_overhead[1] * len(st.trace.params)
        trainable = sum(p.numel for p in st.trace.params if p.requires_grad)
        share = -(-trainable // group) if layout.zero_stage else trainable
        optimizer = share * _ADAM_ACCESSES * 4 / bw * (layout.states > 0)
        tensors = n_step_tensors if layout.zero_stage else sum(p.requires_grad for p in st.trace.params)
        foreach = hardware.device_type == "cuda"
        optimizer += (_ADAM_FOREACH_OPS if foreach else _ADAM_OPS_PER_TENSOR * max(1, tensors)) * op_overhead
        t = StepTime(compute=compute, optimizer=optimizer, comm=crit + dp_comm, copies=0.0)
        if worst is None or t.total > worst.total:
            worst = t
    return worst


def _dp_layout(layout: Layout) -> Layout:
    """The data-parallel engine over ``dp x sp`` that reduces a hybrid rank's gradients (fp32)."""
    return Layout(engine="zero" if layout.zero_stage else "ddp", zero_stage=layout.zero_stage,
                  dp=layout.dp * layout.sp, precision=torch.float32, bucket_numel=layout.bucket_numel,
                  ddp_bucket_cap_mb=layout.ddp_bucket_cap_mb, optimizer=layout.optimizer)  # fmt: skip


def hybrid_comm_bytes(trace: ModelTrace, layout: Layout, buffers: int = 1) -> dict[str, int]:
    """Message bytes per collective per step of the first pipeline rank, keyed ``"<group>:<op>"``
    (``"dp:all_reduce"``, ``"tp:all_reduce"``, ``"pp:send"``, ...)."""
    check_hybrid(trace, layout)
    st = rank_step(trace, layout, 0)
    out: dict[str, int] = {}
    for op, nbytes in comm_calls(st.trace, _dp_layout(layout), buffers):
        out[f"dp:{op}"] = out.get(f"dp:{op}", 0) + nbytes
    for op, nbytes, axis in hybrid_comm_calls(trace, layout, st):
        out[f"{axis}:{op}"] = out.get(f"{axis}:{op}", 0) + nbytes
    return out
