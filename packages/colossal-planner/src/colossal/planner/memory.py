"""Peak bytes per tier of one rank, for every engine, from the trace and the engines' rules.

Each engine adds its model data to the trace's non-model series (:class:`~colossal.planner.trace.
ModelTrace`): what it holds for the whole step (parameters, buffers, optimizer states), what it
allocates and frees at known operators (ZeRO's gradient buckets, stage 3's gathered units), and
the optimizer step's own transients. The peak is the largest sum over the operators of the step.

[Note: the optimizer step's transients]
``torch.optim.AdamW`` on CPU runs its single-tensor loop (torch picks ``foreach`` only for CUDA
tensors): per parameter, ``exp_avg_sq.sqrt()`` and its division by the bias correction live at
once, two temporaries of the parameter's size. On CUDA the ``foreach`` loop makes one list of
square roots of every parameter of a dtype at once. Gradients stay live through the step (they are
freed by ``zero_grad``).

[Note: gloo's scratch copy]
Measured, not read from code: on 2 gloo ranks the allocator shows one extra buffer of the reduced
tensor's size while a gradient all-reduce (DDP's bucket, ZeRO's in-place reduce-scatter fast path)
is in flight; NCCL reduces in place. The rule adds it from launch to finish on CPU only.

The rules restated here, each next to the engine code it comes from, are checked against the real
engines by ``bench/bench_validate_planner.py`` and the meta-package's tests; the planner imports none of
them (``ARCHITECTURE.md``, section 2).
"""

from __future__ import annotations

import dataclasses

import torch

from colossal.planner.hybrid import check_hybrid, rank_step
from colossal.planner.layout import Layout, TierBytes
from colossal.planner.trace import ModelTrace

__all__ = ["MemoryPrediction", "predict_memory", "hybrid_memory"]

_STEP_BYTES = 4  # torch.optim keeps `step` as a float32 scalar tensor per parameter it steps


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPrediction:
    """Peak bytes per tier of one rank, and what they are made of."""

    tiers: TierBytes
    """Peak per tier."""
    breakdown: dict[str, int]
    """Named parts of the device peak (``params``, ``grads``, ``optimizer_states``, ``activations``, ...)."""


class _Timeline:
    """Model data held per operator: a constant plus allocations and frees at operators."""

    def __init__(self, ops: int) -> None:
        self.diff = [0] * (ops + 2)
        self.ops = ops

    def hold(self, start: int, end: int, nbytes: int) -> None:
        """``nbytes`` live from operator ``start`` through operator ``end`` (inclusive)."""
        start = max(0, min(start, self.ops))
        end = max(start, min(end, self.ops))
        self.diff[start] += nbytes
        self.diff[end + 1] -= nbytes

    def peak(self, live: tuple[int, ...], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """(peak of live + held over operators ``lo..hi-1``, the operator where it is reached)."""
        hi = len(live) if hi is None else hi
        cur, best, at = 0, 0, lo
        for j, x in enumerate(live):
            cur += self.diff[j]
            if lo <= j < hi and x + cur > best:
                best, at = x + cur, j
        return best, at


def _optimizer_transient(numels: list[int], device_type: str, states: int) -> int:
    """See [Note: the optimizer step's transients]."""
    if states == 0 or not numels:
        return 0
    if device_type == "cuda":
        return sum(numels) * 4
    return 2 * max(numels) * 4


def _plain_grads(trace: ModelTrace, timeline: _Timeline, w: int) -> None:
    # a gradient autograd produced stays live (as .grad) until the step ends
    for p, op in zip(trace.params, trace.grad_op, strict=True):
        if op >= 0:
            timeline.hold(op + 1, trace.ops, p.numel * w)


def _ddp(trace: ModelTrace, layout: Layout, device_type: str) -> MemoryPrediction:
    """torch DDP (``gradient_as_bucket_view=True``, as ``TorchDDPPlugin`` sets it): the buckets are
    allocated at construction and are the gradients; an incoming gradient is copied into its
    bucket view and freed (it is in the trace's series at the operator that makes it)."""
    w = layout.precision.itemsize
    trainable = [p.numel for p in trace.params if p.requires_grad]
    params = trace.numel * w + trace.buffer_bytes
    buckets = sum(trainable) * w
    states = layout.states * sum(trainable) * 4 + (_STEP_BYTES * len(trainable) if layout.states else 0)
    persistent = params + buckets + states + trace.input_bytes
    tl = _Timeline(trace.ops)
    if device_type == "cpu" and layout.dp > 1:  # [Note: gloo's scratch copy], one bucket at a time
        tl.hold(trace.backward_start, trace.ops, min(buckets, layout.ddp_bucket_cap_mb << 20))
    peak_bwd, _ = tl.peak(trace.live)
    step = _optimizer_transient(trainable, device_type, layout.states)
    device = persistent + max(peak_bwd, step)
    return MemoryPrediction(
        TierBytes(device=device),
        {
            "params": params,
            "grads": buckets,
            "optimizer_states": states,
            "inputs": trace.input_bytes,
            "activations": peak_bwd,
            "step_transient": step,
            "combined": device,
        },  # fmt: skip
    )


@dataclasses.dataclass(slots=True)
class _Flat:
    """One ``colossal.zero`` flat buffer (``_flat_param.FlatParam``): params in order, padded to
    a multiple of the shard group, split evenly."""

    index: list[int]
    numel: int
    world: int

    @property
    def padded(self) -> int:
        return -(-self.numel // self.world) * self.world

    @property
    def shard(self) -> int:
        return self.padded // self.world


def _buckets(trace: ModelTrace, layout: Layout) -> list[_Flat]:
    """``stage12.build_buckets``: trainable parameters in reverse registration order, a new bucket
    when the next one would exceed ``bucket_numel``."""
    flats: list[_Flat] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(trace.params))):
        p = trace.params[i]
        if not p.requires_grad:
            continue
        if cur and size + p.numel > layout.bucket_numel:
            flats.append(_Flat(cur, size, layout.dp))
            cur, size = [], 0
        cur.append(i)
        size += p.numel
    if cur:
        flats.append(_Flat(cur, size, layout.dp))
    return flats


def _units(trace: ModelTrace, layout: Layout) -> list[_Flat]:
    """``stage3.find_units`` + ``assign_params``: one flat per unit (trainable parameters)."""
    flats = []
    for u in range(len(trace.units)):
        idx = [i for i, p in enumerate(trace.params) if p.unit == u and p.requires_grad]
        flats.append(_Flat(idx, sum(trace.params[i].numel for i in idx), layout.dp))
    return flats


def _reduce(
    trace: ModelTrace, tl: _Timeline, flats: list[_Flat], w: int, keep_full: bool, order: list[int], scratch: bool
) -> int:
    """``_reducer.GradReducer``: returns the bytes of the reduced gradient shards held to the step.

    Each flat's ``full_grad`` (padded, working dtype) exists from the first gradient of the flat
    (stages 2/3) or always (stage 1); a flat is reduce-scattered when all its gradients are in and
    the flats before it in ``order`` were launched; at most ``max_inflight`` (2) stay in flight, the
    oldest is finished (its output shard kept, its ``full_grad`` dropped) when a third launches,
    the rest at the end of backward.
    """
    end = trace.ops - 1
    arrive = {}
    for k in order:
        ops = [trace.grad_op[i] for i in flats[k].index if trace.grad_op[i] >= 0]
        arrive[k] = (min(ops) if ops else end, max(ops) if ops else end)
    launch, t = {}, 0
    for k in order:
        t = max(t, arrive[k][1])
        launch[k] = t
    inflight: list[int] = []
    finish = {}
    for k in order:
        inflight.append(k)
        while len(inflight) > 2:
            finish[inflight.pop(0)] = launch[k]
    for k in inflight:
        finish[k] = end
    held = 0
    for k in order:
        f = flats[k]
        if not keep_full:
            tl.hold(arrive[k][0], finish[k], f.padded * w)
        tl.hold(launch[k], finish[k], f.shard * w)  # the reduce-scatter's output
        if scratch:  # see [Note: gloo's scratch copy]
            tl.hold(launch[k], finish[k], f.padded * w)
        if not keep_full:
            tl.hold(finish[k] + 1, trace.ops, f.shard * w)  # kept as the shard's gradient
            held += f.shard * w
    return held


def _zero(trace: ModelTrace, layout: Layout, device_type: str) -> MemoryPrediction:
    w = layout.precision.itemsize
    stage = layout.zero_stage
    flats = _units(trace, layout) if stage == 3 else _buckets(trace, layout)
    frozen = sum(p.numel for p in trace.params if not p.requires_grad)
    tl = _Timeline(trace.ops)
    gloo = device_type == "cpu" and layout.dp > 1
    aliased = layout.precision == torch.float32 and not layout.offload  # offload.place_master
    master = 0 if aliased else sum(f.shard for f in flats) * 4
    states = layout.states * sum(f.shard for f in flats) * 4 + (_STEP_BYTES * len(flats) if layout.states else 0)
    if stage == 3:
        # the persistent shard of every unit; `full` is gathered per unit (stage3.Stage3Engine)
        params = sum(f.shard for f in flats) * w + frozen * w + trace.buffer_bytes
        order = list(range(1, len(flats)))
        order.sort(key=lambda u: trace.unit_forward[u][0])
        root, root_start = flats[0], trace.unit_forward[0][0]
        tl.hold(root_start, trace.ops - 1, root.padded * w)  # the root: forward to end of backward
        k = layout.prefetch  # units gathered ahead (stage3.Stage3Engine)
        for n, u in enumerate(order):
            f = flats[u]
            start, stop = trace.unit_forward[u]
            # prefetched by the unit k before it in forward order (the root's forward for the first k)
            gathered_at = start if k == 0 else trace.unit_forward[order[n - k]][0] if n >= k else root_start
            tl.hold(min(gathered_at, start), stop, f.padded * w)
            bstart = trace.unit_backward[u]
            # in backward by the unit k after it in forward order (the first to run backward: the last)
            later = min(n + k, len(order) - 1)
            bgather = trace.unit_backward[order[later]] if k and later > n else bstart
            ops = [trace.grad_op[i] for i in f.index if trace.grad_op[i] >= 0]
            tl.hold(min(bgather, bstart), max(ops) if ops else trace.ops - 1, f.padded * w)
            # under activation checkpointing the recomputed forward neither prefetches nor frees
            # ([Note: recomputation in backward] in colossal.zero.stage3): the rules above hold
        reduce_order = order[::-1] + [0]  # Stage3: units in reverse order, the root last
        grads = _reduce(trace, tl, flats, w, False, reduce_order, gloo)
    else:
        params = sum(f.padded for f in flats) * w + frozen * w + trace.buffer_bytes
        grads = _reduce(trace, tl, flats, w, stage == 1, list(range(len(flats))), gloo)
        if stage == 1:
            grads = sum(f.padded for f in flats) * w
    # offload.master_grad: `grad.to(fp32, master's device)` copies unless it is already both
    copies = not aliased and not (layout.precision == torch.float32 and (device_type == "cpu" or not layout.offload))
    master_grads = sum(f.shard for f in flats) * 4 if copies else 0
    # the offloaded step runs on the host: torch's CPU loop (single-tensor)
    step_temp = _optimizer_transient([f.shard for f in flats], "cpu" if layout.offload else device_type, layout.states)
    if layout.offload:  # masters, their gradients, the states and the step itself on the host
        host_persistent, host_step = master + states, master_grads + step_temp
        dev_master = dev_states = dev_step = 0
    else:
        host_persistent = host_step = 0
        dev_master, dev_states, dev_step = master, states, master_grads + step_temp
    persistent = params + dev_master + dev_states + trace.input_bytes + (grads if stage == 1 else 0)
    peak_bwd, _ = tl.peak(trace.live)
    held_grads = grads if stage != 1 else 0  # stage 1's are in `persistent`
    device = persistent + max(peak_bwd, held_grads + dev_step)
    host = host_persistent + host_step
    pinned = host_persistent if (layout.offload and device_type == "cuda") else 0
    # one pool on a CPU-only machine: the step's host transients meet the device's held gradients
    combined = persistent + host_persistent + max(peak_bwd, held_grads + dev_step + host_step)
    tiers = TierBytes(device=device, pinned_host=pinned, host=host - pinned)
    return MemoryPrediction(
        tiers,
        {
            "params": params,
            "grads": grads,
            "master": master,
            "optimizer_states": states,
            "master_grads": master_grads,
            "inputs": trace.input_bytes,
            "activations": peak_bwd,
            "step_transient": step_temp,
            "combined": combined,
            "optimizer_tensors": len(flats),
        },  # fmt: skip
    )


def hybrid_memory(trace: ModelTrace, layout: Layout, device_type: str):
    """Peak bytes of the busiest pipeline rank (a :class:`~colossal.planner.MemoryPrediction`)."""
    check_hybrid(trace, layout)
    group = layout.dp * layout.sp  # gradients are averaged over dp x sp
    best = None
    for r in range(layout.pp):
        st = rank_step(trace, layout, r)
        t = st.trace
        if layout.zero_stage:
            inner = Layout(engine="zero", zero_stage=layout.zero_stage, dp=group, precision=torch.float32,
                           bucket_numel=layout.bucket_numel, optimizer=layout.optimizer)  # fmt: skip
            mem = _zero(t, inner, device_type)
            breakdown = dict(mem.breakdown)
            tiers = mem.tiers
        else:
            # DDP over dp x sp (gradient_as_bucket_view off: buckets beside the .grad tensors); under
            # pp one flat all-reduce after the pipeline (pp.average_over_dp); one rank: plain grads
            trainable = [p.numel for p in t.params if p.requires_grad]
            params = t.numel * 4 + t.buffer_bytes
            grads = sum(trainable) * 4
            states = layout.states * grads + (_STEP_BYTES * len(trainable) if layout.states else 0)
            tl = _Timeline(t.ops)
            for p, op in zip(t.params, t.grad_op, strict=True):
                if op >= 0:
                    tl.hold(op + 1, t.ops, p.numel * 4)
            gloo = device_type == "cpu"
            buckets = grads if (group > 1 and layout.pp == 1) else 0
            if buckets and gloo:  # [Note: gloo's scratch copy] in memory.py, one bucket at a time
                tl.hold(t.backward_start, t.ops, min(buckets, layout.ddp_bucket_cap_mb << 20))
            peak_bwd, _ = tl.peak(t.live)
            flat = grads * (2 if gloo else 1) if (group > 1 and layout.pp > 1) else 0
            step = _optimizer_transient(trainable, device_type, layout.states)
            persistent = params + buckets + states + t.input_bytes
            after = grads + max(flat, step)  # after backward: the gradients, then the flat average or the step
            device = persistent + max(peak_bwd, after)
            tiers = TierBytes(device=device)
            breakdown = {"params": params, "grads": grads, "buckets": buckets, "optimizer_states": states,
                         "inputs": t.input_bytes, "activations": peak_bwd, "step_transient": step,
                         "combined": device, "optimizer_tensors": len(trainable)}  # fmt: skip
        breakdown.update(pp_rank=r, in_flight_bytes=st.in_flight_bytes, autocast_bytes=st.autocast_bytes,
                         rank_params=t.numel)  # fmt: skip
        if best is None or tiers.device > best.tiers.device:
            best = MemoryPrediction(tiers, breakdown)
    return best


def predict_memory(
    trace: ModelTrace, layout: Layout, *, device_type: str = "cpu", device_memory: int | None = None
) -> MemoryPrediction:
    """Peak bytes per tier of one rank running ``layout`` on the traced step (a :class:`MemoryPrediction`).

    ``device_memory`` is the device's capacity: Gemini plans its placement within it (or within
    ``layout.device_budget``), so one of the two is required for a Gemini layout.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if layout.engine == "gemini" and layout.device_budget is None and not device_memory:
        raise ValueError("a Gemini layout needs a device budget: give device_memory= or Layout(device_budget=...)")
    if layout.engine == "ddp":
        return _ddp(trace, layout, device_type)
    if layout.engine == "zero":
        return _zero(trace, layout, device_type)
    if layout.engine == "hybrid":
        return hybrid_memory(trace, layout, device_type)
    from colossal.planner.gemini import gemini_memory

    tiers, breakdown = gemini_memory(trace, layout, device_memory=device_memory or 0, device_type=device_type)
    # Gemini's device figure is its accounting (GeminiStats); on a CPU-only machine device and host
    # share one allocator, and the input batch sits outside the account
    breakdown["combined"] = tiers.device + tiers.host_total + trace.input_bytes
    breakdown["optimizer_tensors"] = breakdown["n_trainable_chunks"]  # a frozen chunk is never stepped
    # traffic of the optimizer blocks (the speed model's): a block on the host gets its gradient
    # shard and sends back the updated working shard every step; a block on the disk streams in and
    # out once per step (disk.stream_step)
    blocks = breakdown["optimizer_blocks"]
    host_frac = 1.0 - breakdown["optimizer_blocks_device"] / blocks if blocks else 0.0
    breakdown["optimizer_host_permille"] = round(1000 * host_frac)
    breakdown["bytes_moved_per_step"] += round(host_frac * 2 * breakdown["trainable_chunks"])
    if layout.disk:
        breakdown["disk_read_per_step"] += tiers.disk
        breakdown["disk_written_per_step"] += tiers.disk
    return MemoryPrediction(tiers, breakdown)
