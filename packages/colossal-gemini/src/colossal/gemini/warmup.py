"""End of warm-up: turn the traced iteration into a placement (policy, optimizer blocks, Belady optimum).

[Note: optimizer blocks in the auto policy]
A chunk's optimizer block (fp32 master + fp32 gradient + optimizer states, ~16 bytes per element
for Adam) saves, when on the device, two shard copies per step (gradient out, refreshed weights
in). A working chunk (2-4 bytes per element) on the device saves up to two fetches and two
evictions per step (forward and backward use). Per byte of device memory, keeping working chunks
resident saves 4-16x more traffic, so the auto policy gives optimizer blocks only the room left
once *every* working chunk fits next to the peak operator; the step then runs on the device for
those blocks (fused kernel) and on the host for the others (CPU kernel).
"""

from __future__ import annotations

from colossal.gemini.placement import AutoPolicy, StaticPolicy, belady, belady_two_level
from colossal.gemini.prefetch import build_prefetcher
from colossal.gemini.tiers import BudgetExceededError

__all__ = ["finish_warmup", "optimum_bytes"]


def _unit(manager, chunk) -> int:
    """Device bytes a resident working chunk holds between uses."""
    return chunk.shard_nbytes if manager.sharded else chunk.nbytes


def _payload(manager, op) -> int:
    """Transient gathered payloads of a sharded operator (its own chunks, those its recomputations gather
    and those held gathered next to it)."""
    ids = set(op.chunk_ids) | set(op.recompute_chunk_ids) | set(op.held_chunk_ids)
    return sum(manager.chunks[c].nbytes for c in ids) if manager.sharded else 0


def _auto_optim_on_device(ddp, block_bytes: dict[int, int]) -> set[int]:
    m, trace = ddp.manager, ddp.trace
    peak = max((op.non_model_bytes + op.pinned_bytes + _payload(m, op) for op in trace.ops), default=0)
    margin = m.device.budget - peak - sum(_unit(m, c) for c in m.chunks)
    chosen: set[int] = set()
    for c in m.chunks:
        if block_bytes[c.id] <= margin:
            chosen.add(c.id)
            margin -= block_bytes[c.id]
    return chosen


def _static_check(ddp, policy: StaticPolicy, o_device_bytes: int) -> None:
    m, budget = ddp.manager, ddp.manager.device.budget
    homed = sum(_unit(m, c) for c in m.chunks if c.id not in policy.host_homed)
    for i, op in enumerate(ddp.trace.ops):
        ids = set(op.chunk_ids) | set(op.recompute_chunk_ids) | set(op.held_chunk_ids)
        visiting = sum(_unit(m, m.chunks[c]) for c in ids if c in policy.host_homed)
        need = op.non_model_bytes + op.pinned_bytes + o_device_bytes + homed + visiting + _payload(m, op)
        if need > budget:
            raise BudgetExceededError(
                f"static placement: need {need} bytes on the device at operator {i} ({op.label}), budget {budget}; "
                f"raise offload_param_frac (now {ddp.config.offload_param_frac}) or offload_optim_frac "
                f"(now {ddp.config.offload_optim_frac}), or use placement='auto'"
            )


def finish_warmup(ddp, optimizer) -> None:
    """Choose the policy and the optimizer-block tiers from the trace; move blocks; compute the optimum."""
    m, cfg = ddp.manager, ddp.config
    blocks = {c.id: optimizer.block_bytes(c) for c in m.chunks}
    train = m.trainable  # frozen chunks have no optimizer block ([Note: frozen chunks] in chunk.py)
    if cfg.placement == "static":
        n = len(train)
        o_device = {c.id for c in train[: n - round(cfg.offload_optim_frac * n)] if not c.on_disk}
        policy = StaticPolicy(m, ddp._reserve, cfg.offload_param_frac)
        _static_check(ddp, policy, sum(blocks[c] for c in o_device))
    else:
        o_device = _auto_optim_on_device(ddp, blocks) - {c.id for c in m.chunks if c.on_disk}
        policy = AutoPolicy(m, ddp._reserve, ddp.trace, cfg.disk_prefetch if m.disk is not None else 0)
    ddp.warmup = False
    policy.where, policy.advice = ddp.describe_op, ddp.budget_advice
    ddp.policy = policy
    for c in m.chunks:
        if c.id not in o_device:
            optimizer.move_block(c, "host")
    for c in m.chunks:
        if c.id in o_device:
            policy.make_room(blocks[c.id], set(), -1)
            optimizer.move_block(c, "device")
    if isinstance(policy, StaticPolicy):
        for c in m.chunks:
            if c.id in policy.host_homed:
                m.evict(c)
    if m.sharded and cfg.prefetch > 0:
        ddp.prefetcher = build_prefetcher(ddp, sum(blocks[c] for c in o_device))
    ddp.belady_bytes = optimum_bytes(ddp, sum(blocks[c] for c in o_device), o_device)
    if m.disk is not None:
        ddp.belady_disk_bytes = optimum_disk_bytes(ddp, sum(blocks[c] for c in o_device))


def optimum_disk_bytes(ddp, o_device_bytes: int) -> int:
    """Disk bytes per steady-state step of the offline optimum for the same disk plan: working-shard
    reads of the two-level optimum (:func:`~colossal.gemini.placement.belady_two_level`) plus the
    block I/O every schedule of that plan does (read master, gradient and states of each disk block,
    write master and states back; gradients written once by backward)."""
    m, trace = ddp.manager, ddp.trace
    unit = _unit(m, m.chunks[0])
    caps = [
        max(0, (m.device.budget - op.non_model_bytes - op.pinned_bytes - o_device_bytes - _payload(m, op)) // unit)
        for op in trace.ops
    ]
    caps = [max(cap, len(op.chunk_ids)) for cap, op in zip(caps, trace.ops)]
    if isinstance(ddp.policy, StaticPolicy):  # the host holds every shard that is not disk-homed
        host_cap = len(m.chunks) - len(m.disk_homed)
    else:
        host_cap = (m.host_allowance or 0) // m.chunks[0].shard_nbytes
    reads = belady_two_level([frozenset(op.chunk_ids) for op in trace.ops], caps, host_cap, cycles=3).disk_reads
    block = 0
    for c in m.chunks:
        n4 = c.shard_size * 4
        states = 2 * n4
        block += ("master" in c.on_disk) * 2 * n4 + ("grad" in c.on_disk) * 2 * n4
        block += ("states" in c.on_disk) * 2 * states
    return reads * unit + block


def optimum_bytes(ddp, o_device_bytes: int, o_device: set[int]) -> int:
    """Bytes per steady-state step of the offline optimum: Belady on the trace, plus the step's copies."""
    m, trace = ddp.manager, ddp.trace
    unit = _unit(m, m.chunks[0])
    caps = [
        max(0, (m.device.budget - op.non_model_bytes - op.pinned_bytes - o_device_bytes - _payload(m, op)) // unit)
        for op in trace.ops
    ]
    caps = [max(cap, len(op.chunk_ids)) for cap, op in zip(caps, trace.ops)]
    res = belady([frozenset(op.chunk_ids) for op in trace.ops], caps, frozenset(), cycles=3)
    # the step copies each host-placed block's gradient out, and its refreshed weights back in when the
    # working chunk is on the device at that point
    step = sum(c.shard_nbytes * (1 + (c.id in res.resident)) for c in m.chunks if c.id not in o_device)
    return (res.loads + res.evictions) * unit + step
