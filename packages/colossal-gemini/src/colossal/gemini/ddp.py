"""GeminiDDP: wraps a module so that its parameters live in chunks placed across tiers and ranks.

Hooks drive the tensor states (see :mod:`colossal.gemini.chunk`):

* forward pre-hook of every module owning parameters: fetch its chunks (placement decides what to
  evict), HOLD -> COMPUTE; forward post-hook: COMPUTE -> HOLD, and a hook on each output that
  will fire when its gradient arrives, i.e. just before the module's backward (pre-backward);
* pre-backward: the previous backward operator's tensors COMPUTE -> HOLD_AFTER_BWD, fetch, -> COMPUTE;
* ``Tensor.register_post_accumulate_grad_hook`` on every parameter: the gradient goes into the
  chunk's gradient buffer, -> READY_FOR_REDUCE; a chunk whose tensors are all ready is reduced
  (reduce-scatter over the data-parallel group, overlapping the rest of backward); a chunk kept on
  the device only for that gradient is released (see ``[Note: parent modules]``);
* a callback at the end of backward reduces chunks holding unused parameters, so they never hang.

[Note: parent modules]
A module may own parameters *and* call children (a root with a ``cls_token``, ``return
self.head(x)``). Its pre-backward hook can then fire before a child's backward has run (both
hooks fire first when the child's output is the parent's output), or the parent's own backward
ops run after a child's operator has begun. So a tensor whose operator was left but whose
gradient has not arrived (HOLD_AFTER_BWD) keeps its chunk on the device (``Chunk.in_use``) while
autograd still holds views of the chunk saved for backward; the post-accumulate-grad hook releases
it once the gradient is in. A ``saved_tensors_hooks`` pair counts those saved views
(``Chunk.saved``: a tied weight whose backward op has run, but whose gradient waits for its other
use, pins nothing) and checks on every unpack that the chunk is gathered, raising instead of
letting autograd read freed storage.

[Note: shared parameters]
One parameter may belong to several modules (``m.parameters(recurse=False)`` of each lists it): two
siblings (tied input/output embeddings), or a parent and its child that both compute with it in one
forward (Hugging Face BERT ties ``cls.predictions.bias`` to ``cls.predictions.decoder.bias``).
* Forward: the modules' operators nest, so the tensor is entered once per operator
  (``TensorInfo.users``, ``Chunk.enter``/``Chunk.leave``) and goes back to HOLD only when the last of
  them has left: the parent's chunk stays pinned through the child and any operator after it, until
  the parent's own forward is done.
* Backward: operators run one at a time, so a second user just takes the tensor over (COMPUTE stays
  COMPUTE). Autograd accumulates a parameter's gradient once per graph task, the sum of all its uses;
  reentrant checkpointing runs one inner backward per recomputed segment, so a parameter shared by two
  segments receives its gradient in parts. A part is added to what its slot holds
  (``TensorInfo.grads``); a module that begins its backward after a part came moves the tensor from
  READY_FOR_REDUCE back to COMPUTE (its chunk waits for the next part); a part that comes after its
  chunk was reduced goes into a new buffer and the chunk is reduced again (reductions are linear and
  ``grad_shard`` accumulates), at the latest at the end of backward. Every part therefore counts
  exactly once, as in plain PyTorch.
* The pass ends with the outermost backward: a hook on the wrapped module's outputs begins it, else
  a model whose every module runs under reentrant checkpointing would begin and end it inside the
  first inner backward.

[Note: recomputation]
Activation checkpointing runs module forwards again inside backward (non-reentrant: when autograd
unpacks a saved activation; reentrant: inside the checkpoint's backward). Such a forward is not an
operator: its chunks are fetched and pinned (``Chunk.pins``) for the duration of the forward,
tensor states are left alone (the current backward operator's tensors stay COMPUTE), and the
chunks are released on its post-hook or, when the recomputation stops early (no post-hook), at the
next pre-backward or at the end of backward. Warm-up records them in the enclosing operator's
``OpRecord.recompute_chunk_ids``, so the optimizer-block margin, the static check and the prefetch
plan leave room for their gathered payloads.

[Note: departures from the trace]
After warm-up the room kept for non-model data at operator ``i`` is what the trace measured at
operator ``i``. An iteration that departs from the trace (a module skipped, one more micro-batch)
shifts the indices: operator ``i`` may be a backward op whose traced counterpart is the peak
forward op, and the budget check fails although the memory would fit. So an operator that is not
the traced operator ``i`` reserves the bytes of the traced operator with the same label and chunks
(the largest, when it ran several times), and the traced peak when there is none; past the end of
the trace the peak is used as before. The traced gradient-buffer bytes of an operator are reserved
less the live buffers and less the buffer being made room for (it is one of the traced ones).

[Note: held chunks]
A chunk can stay gathered through operators that do not use it: a tensor whose operator was left but
whose gradient has not arrived (a tied input/output embedding waits for its second use, an unused
parameter of a module that ran waits for the end of backward) keeps its chunk while autograd still
holds saved views of any tensor of that chunk (see [Note: parent modules]). Warm-up records those
chunks per operator (``OpRecord.held_chunk_ids``); the prefetch plan and the optimizer-block margin
count their payloads next to the operator's own, otherwise a window that fits on paper overflows
the budget in steady state.

[Note: operators]
The unit of tracing and placement is one module's forward or one module's backward ("operator"):
that is the granularity at which chunks are needed. Parameters must be used inside the forward of
the module owning them (as for FSDP).

[Note: fixed reduction order]
Collectives pair by issue order. With whole chunks on every rank (``keep_gathered``) a module skipped
on one rank only (a data-dependent branch, a layer drop) is legal for the data, but that rank's chunk
would complete at the end of backward instead of in its turn, and the per-chunk all-reduces would pair
different chunks across ranks (same sizes: silently wrong gradients). So, as DDP does with its
buckets, replicated chunks are all-reduced in one fixed order that every rank knows without
communicating (descending chunk id: chunks are packed in first-use order, so this is the natural
backward order): a chunk whose gradients are all in waits for the chunks before it in that order, and
at the end of backward the chunks not reduced yet go in that order, a rank that produced none of a
chunk's gradients contributing zeros. Whether a parameter got a gradient is agreed over the ranks at
the step (``gemini.grad_presence``), so a parameter no rank used is left untouched, as by
``torch.optim``. Sharded chunks (reduce-scatter) keep their completion order: there every module's
gathers already require every rank to run the same modules.

[Note: resident fast path]
Operators exist to move chunks. After warm-up, when chunks are not sharded, every chunk is on the
device and the budget holds the model data, the largest traced non-model peak and every gradient
buffer at once, no operator can fetch, evict, gather or release anything: the trace shows no benefit
from any operator granularity, so an iteration is one operator. ``forward`` then detaches the module
hooks and the saved-tensor hooks (about 40 us of Python per module call and per saved parameter)
and runs the plain module; only the per-parameter gradient hooks stay (a gradient must still go
into its chunk, and chunks are still reduced as they complete). The check is redone at every
``forward`` (a checkpoint load or an observer, e.g. the profiler, which wants per-module samples,
turns the hooks back on), so leaving the fast path is always possible.

[Note: native gradients]
On one rank (nothing to reduce) with every master aliased to its working chunk (``[Note: aliased
masters]`` in ``colossal.gemini.chunk_manager``: fp32, the optimizer steps the parameters' own
storage), a gradient needs no chunk either: the fast path also detaches the per-parameter gradient
hooks and leaves each gradient in ``param.grad``, where autograd's ``AccumulateGrad`` puts it (and
adds the next micro-batch's to it), exactly as for a plain module. ``GeminiOptimizer.step`` hands
those tensors (flattened views, no copy) to the wrapped optimizer, checks, unscales and clips them,
and a parameter whose ``.grad`` is None is left untouched, as by ``torch.optim``. The fp32 gradient
shards are not used then: their storage is dropped while native (autograd's gradients take those
accounted bytes) and given back when an iteration leaves the fast path (``_leave_native``: the
gradients in ``param.grad`` are moved into the chunks first, and the hooks come back), so any
iteration after can still fetch, evict, reduce or accumulate as usual. Only a pass that starts with
no gradient in the chunks goes native (an earlier non-native pass of the same step keeps hooks on).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from colossal.comm.hooks import weak_hook
from colossal.comm.memory import rss_and_peak_bytes
from colossal.gemini import checkpoint, events
from colossal.gemini.chunk import Chunk, ChunkState, TensorState
from colossal.gemini.chunk_manager import ChunkManager
from colossal.gemini.config import GeminiConfig
from colossal.gemini.host_memory import bound_host_allocator
from colossal.gemini.order import first_use_order
from colossal.gemini.placement import WarmupPolicy
from colossal.gemini.prefetch import Prefetcher
from colossal.gemini.stats import GeminiStats
from colossal.gemini.tiers import BudgetExceededError, DeviceTier, HostTier
from colossal.gemini.tracer import NonModelTracker, OpRecord, Trace
from colossal.gemini.warmup import finish_warmup

__all__ = ["GeminiDDP"]


def _untracks_on_error(method):
    """Run a hook of :class:`GeminiDDP`; when it raises, pop the warm-up tracker first
    (:meth:`GeminiDDP._stop_tracking`): an error in backward surfaces from autograd, where nothing
    of ours would run again to pop it."""

    @functools.wraps(method)
    def hook(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self._stop_tracking()
            raise

    return hook


class GeminiDDP(nn.Module):
    """Train ``module`` with its parameters in chunks placed across the device and host tiers (and ranks).

    ``GeminiDDP(model, placement="auto", device_memory_budget=64 << 20, mixed_precision=torch.bfloat16)``;
    pair it with :class:`~colossal.gemini.GeminiOptimizer`.
    """

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.config = GeminiConfig(**kwargs)
        self.module = module
        params = list(dict.fromkeys(module.parameters()))
        if self.config.example_inputs is not None:
            params = first_use_order(module, params, self.config.example_inputs)
        names = {p: n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        named = [(names[p], p) for p in params]
        self.dtype = self.config.mixed_precision or torch.float32
        group = self.config.group
        dev = torch.device(self.config.device)
        if self.config.disk_dir is not None or self.config.host_memory_budget is not None:
            bound_host_allocator()  # before the chunks exist: [Note: the allocator's peak]
        self.manager = ChunkManager(
            named,
            chunk_size=self.config.chunk_size,
            dtype=self.dtype,
            device=DeviceTier(dev, self.config.device_memory_budget),
            host=HostTier(pin=dev.type == "cuda"),
            group=group if dist.is_initialized() else None,
            keep_gathered=self.config.keep_gathered,
        )
        self._module_chunks = self._collect_module_chunks(module)
        self._check_setup()
        if self.config.disk_dir is not None:  # plan, free-space check and file: before any collective
            from colossal.gemini.disk import setup

            setup(self)
        self.manager.materialise(self.config.param_init_fn)
        if self.manager.disk is not None:  # per-step disk counters start after the placement writes
            self._disk_last = self.manager.disk.counters()
        self._fresh_trace()
        self._storage_chunk = {c.payload.untyped_storage()._cdata: c for c in self.manager.chunks}
        self._model_keys = set(self._storage_chunk)
        self.policy = WarmupPolicy(self.manager, self._reserve)
        self.policy.where, self.policy.advice = self.describe_op, self.budget_advice
        self.manager.device.advice = self.budget_advice
        self.warmup = True
        self.belady_bytes: int | None = None
        self.prefetcher: Prefetcher | None = None  # set at the end of warm-up (sharded runs, prefetch > 0)
        self.stats_history: list[GeminiStats] = []
        # replicated chunks are all-reduced in this fixed order on every rank: [Note: fixed reduction order]
        self._reduce_order = [c.id for c in reversed(self.manager.trainable)]
        self._next_reduce = 0  # position in _reduce_order of the next chunk to reduce
        self._inflight: Chunk | None = None  # the reduction in flight
        self._fast_need = 0  # bytes the resident fast path needs free next to the model data (set after warm-up)
        self._fast_non_model = 0  # the non-model part of it (the largest traced peak)
        self._reset_iteration()
        self._native = False  # see [Note: native gradients]
        self._native_params = [(info.param, info.name) for c in self.manager.trainable for info in c.tensors]
        self._handles = self._grad_hooks()
        self._module_handles: list = []
        self._attach_module_hooks()

    def __setattr__(self, name: str, value) -> None:
        # per-operator state: plain attributes (nn.Module.__setattr__ is slow, and would register
        # the module held in _bwd_module as a child)
        if name in _RUNTIME:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # -- setup ----------------------------------------------------------------------------------------
    def _collect_module_chunks(self, module: nn.Module) -> dict[nn.Module, tuple[str, list[Chunk], list]]:
        out = {}
        for name, m in module.named_modules():
            own = list(m.parameters(recurse=False))
            if own:
                pairs = [self.manager.chunk_of[p] for p in own]
                chunks = sorted({c.id: c for c, _ in pairs}.values(), key=lambda c: c.id)
                out[m] = (name or "<root>", chunks, pairs)
        return out

    def _check_setup(self) -> None:
        """Up-front error when one module's chunks alone cannot fit the device budget."""
        need = max(
            sum(self.manager.device_bytes_to_fetch(c) for c in chunks) for _, chunks, _ in self._module_chunks.values()
        )
        budget = self.manager.device.budget
        if need > budget:
            raise BudgetExceededError(
                f"need {need} bytes on the device for the chunks of one module, budget {budget}; "
                f"raise device_memory_budget or lower chunk_size (now {self.manager.chunk_size} elements)"
            )

    def _attach_module_hooks(self) -> None:
        if not self._module_handles:
            for m in self._module_chunks:
                self._module_handles.append(m.register_forward_pre_hook(self._pre_forward))
                self._module_handles.append(m.register_forward_hook(self._post_forward))

    def _detach_module_hooks(self) -> None:
        for h in self._module_handles:
            h.remove()
        self._module_handles = []

    def _resident(self) -> bool:
        """Whether this iteration can skip the operator hooks (see ``[Note: resident fast path]``)."""
        m = self.manager
        if self.warmup or m.sharded or self._fast_need <= 0 or events.has_observers():
            return False
        if m.device.used_bytes + m.grad_buffer_bytes + self._fast_need > m.device.budget:
            return False
        return all(c.state is ChunkState.GATHERED and c.w_tier == "device" for c in m.chunks)

    def plan_fast_path(self) -> None:
        """After warm-up: the free bytes an iteration with every chunk resident needs (the largest traced
        non-model peak and every gradient buffer at once), or 0 when a policy may still evict by itself."""
        m, ops = self.manager, self.trace.ops
        if getattr(self.policy, "host_homed", None):  # static: host-homed chunks are evicted after each use
            self._fast_need = 0
            return
        non_model = max([self.trace.peak_non_model_bytes] + [op.non_model_bytes for op in ops])
        buffers = sum(c.nbytes for c in m.trainable if not m.direct_grad(c))
        self._fast_non_model = non_model
        self._fast_need = max(1, non_model + buffers)

    def describe_op(self, i: int) -> str:
        """``"operator <i> (<fwd|bwd>:<module name>)"``: how budget errors name where they happened."""
        ops = self.trace.ops
        label = self._op_label or (ops[i].label if 0 <= i < len(ops) else "")
        return f"operator {i} ({label})" if label else f"operator {i}"

    def budget_advice(self) -> str:
        """The settings that can make a step fit, for this configuration (not the ones in force)."""
        cfg, tips = self.config, ["raise device_memory_budget"]
        if self.prefetcher is not None and cfg.prefetch > 0:
            tips.append(f"lower prefetch (now {cfg.prefetch}; 0 gathers on demand)")
        tips.append(f"lower chunk_size (now {self.manager.chunk_size} elements)")
        if cfg.placement == "static":
            tips.append(f"raise offload_param_frac (now {cfg.offload_param_frac}) or use placement='auto'")
        if self.warmup:
            tips.append("lower the batch size (activations are measured in this first step)")
        return ", ".join(tips[:-1]) + " or " + tips[-1]

    def _is_model_storage(self, key: int) -> bool:
        return key in self._model_keys

    def _reset_iteration(self) -> None:
        self.op_index = 0
        self._current: list[Chunk] = []
        self._bwd_infos: list = []
        self._bwd_module: nn.Module | None = None
        self._in_backward = False
        self._recomputing: list[Chunk] = []
        self._aligned = (-2, -2)  # (operator index, traced operator standing for it)
        self._peak = [0, 0, 0]  # model, non-model, total
        self._pinned = 0

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the wrapped module (floating-point inputs are cast to the working precision)."""
        if self.dtype != torch.float32:
            cast = lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if self._resident():  # see [Note: resident fast path]
            if self._module_handles:
                self._detach_module_hooks()
            if self._native_ok():
                self._enter_native()
            else:
                self._leave_native()
            m = self.manager
            model, non_model, peak = m.device.used_bytes, self._fast_non_model, self._peak
            self._peak = [max(peak[0], model), max(peak[1], non_model), max(peak[2], model + non_model)]
            return self._mark_backward_start(self.module(*args, **kwargs))
        self._leave_native()
        self._attach_module_hooks()
        self.pop_inert_tracker()
        if self.warmup and torch.is_grad_enabled() and not self._tracking:
            self.tracker.__enter__()
            self._tracking = True
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            try:
                return self._mark_backward_start(self.module(*args, **kwargs))
            except BaseException:
                self._stop_tracking()
                raise

    def _stop_tracking(self) -> None:
        """Pop the warm-up tracker (a dispatch mode that sees every operator) after an exception: left
        pushed, it slowed every later torch call of the process 100x and kept this model alive. The
        warm-up starts again at the next forward.

        Inside backward the pop would not last (the autograd engine restores the caller's dispatch
        modes when it unwinds), so there the tracker goes inert (``NonModelTracker.go_inert``: it
        tracks nothing and holds no reference to this model, which can be collected); the first of
        ``GeminiOptimizer.backward`` (the booster's backward), ``GeminiOptimizer.zero_grad`` /
        ``step`` and this model's next forward to run after the error left autograd pops it."""
        if not self._tracking:
            return
        if torch._C._current_graph_task_id() != -1:
            self.tracker.go_inert()
            return
        self.tracker.__exit__(None, None, None)
        self._tracking = False
        self._fresh_trace()

    def pop_inert_tracker(self) -> None:
        """Pop the warm-up tracker left inert by an error inside backward (``_stop_tracking``); a
        no-op otherwise, and inside backward."""
        if self._tracking and self.tracker.passthrough:
            self._stop_tracking()

    def _fresh_trace(self) -> None:
        """Trace the next iteration afresh (a skipped or abandoned warm-up)."""
        self.trace = Trace()
        self.tracker = NonModelTracker(self._is_model_storage)

    def _native_ok(self) -> bool:
        """Whether this (resident) iteration can leave gradients in ``param.grad`` (``[Note: native gradients]``)."""
        m = self.manager
        if self._native:  # a further micro-batch: its gradients add to param.grad
            return True
        return m.dp_size == 1 and all(m.aliased(c) and not c.has_grad and c.grad_buffer is None for c in m.trainable)

    def _enter_native(self) -> None:
        if self._native:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        for c in self.manager.trainable:  # autograd's gradients stand in for these accounted bytes
            c.grad_shard.untyped_storage().resize_(0)
        self._native = True

    def _leave_native(self) -> None:
        """Move the gradients autograd left in ``param.grad`` into the chunks; hooks back on."""
        if not self._native:
            return
        self._native = False
        for c in self.manager.trainable:
            c.grad_shard.untyped_storage().resize_(c.grad_shard.numel() * c.grad_shard.element_size())
            got = [info for info in c.tensors if info.param.grad is not None]
            if not got:
                continue  # has_grad stays False: the next step reads zeros
            c.grad_shard.zero_()
            for info in got:
                c.grad_shard[info.offset : info.offset + info.numel].copy_(info.param.grad.reshape(-1))
                c.got_grad.add(info.offset)
                info.param.grad = None
            c.has_grad = True
        self._handles = self._grad_hooks()

    def _grad_hooks(self) -> list:
        """A post-accumulate-grad hook on every parameter that has gradients (none on frozen ones)."""
        return [p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready)) for p, _ in self._native_params]

    def native_grads(self) -> list[tuple[nn.Parameter, str]] | None:
        """``(parameter, name)`` of every parameter when gradients are in ``param.grad`` (``[Note: native
        gradients]``), else None."""
        return self._native_params if self._native else None

    def _mark_backward_start(self, output):
        """Begin the backward pass when the output's gradient arrives, i.e. in the outermost backward: with
        every module under reentrant checkpointing the first module hook runs in an inner backward, whose
        end would otherwise close the pass (all chunks reduced once per inner backward)."""
        if torch.is_grad_enabled() and not self._in_backward:
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._output_grad)
        return output

    @_untracks_on_error
    def _output_grad(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._enter_backward()

    def _pack(self, t: torch.Tensor):
        chunk = self._storage_chunk.get(t.untyped_storage()._cdata)
        return t if chunk is None else _Saved(t, chunk)

    @_untracks_on_error
    def _unpack(self, packed):
        if type(packed) is not _Saved:
            return packed
        t, chunk = packed.tensor, packed.chunk
        if chunk.state is not ChunkState.GATHERED:
            raise RuntimeError(
                f"GeminiDDP: autograd needs a parameter of chunk {chunk.id} ({[i.name for i in chunk.tensors]}) "
                "that is not on the device (its storage was released); a parameter is probably used outside "
                "the forward of the module owning it. See [Note: parent modules] in colossal.gemini.ddp"
            )
        return t

    _tracking = False
    _op_label = ""  # label of the operator being run (budget errors name it)
    _new_grad = 0  # bytes of the gradient buffer being made room for (counted once: see _reserve)
    _record_open = False
    _op_model = 0

    def _pre_forward(self, module: nn.Module, args) -> None:
        name, chunks, pairs = self._module_chunks[module]
        if self._in_backward:  # activation checkpointing: see [Note: recomputation]
            self._recompute_fetch(name, chunks)
            return
        self._begin_op(f"fwd:{name}", chunks)
        for chunk, info in pairs:
            chunk.enter(info)  # a parameter shared with an enclosing module gets one more user

    def _post_forward(self, module: nn.Module, args, output):
        _, chunks, pairs = self._module_chunks[module]
        if self._in_backward:
            self._recompute_done(chunks)
        else:
            for chunk, info in pairs:
                chunk.leave(info, TensorState.HOLD)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, module))
        return output

    def _recompute_fetch(self, name: str, chunks: list[Chunk]) -> None:
        with self.tracker.suspended(), events.label("placement"):
            i = self.op_index - 1
            self.policy.before_op(i, chunks)
            if self.warmup and self._record_open:  # the placement must leave room for them
                op = self.trace.ops[-1]
                op.recompute_chunk_ids = tuple(dict.fromkeys(op.recompute_chunk_ids + tuple(c.id for c in chunks)))
            for c in chunks:
                c.pins += 1
            self._recomputing.extend(chunks)
            self._sample(f"recompute:{name}", i)

    def _recompute_done(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            c.pins -= 1
            self._recomputing.remove(c)
        self._release_idle(chunks)

    def _unpin_recompute(self) -> None:
        """Recomputations that stopped early (no post-hook) leave their pins: drop them."""
        left, self._recomputing = self._recomputing, []
        for c in left:
            c.pins -= 1
        self._release_idle(left)

    def _release_idle(self, chunks: list[Chunk]) -> None:
        """Let the policy release/evict ``chunks`` that the current operator and the prefetch window do not hold."""
        if chunks:
            keep = set(self.policy.protected) | {c.id for c in self._current}
            with self.tracker.suspended():
                self.policy.after_op([c for c in chunks if c.id not in keep], keep)

    # -- operators ------------------------------------------------------------------------------------
    def _reserve(self, i: int) -> int:
        """Non-model bytes to keep free at operator ``i`` (see ``[Note: departures from the trace]``)."""
        if self.warmup:
            return self.tracker.current()
        if i == self._aligned[0]:
            i = self._aligned[1]
        ops = self.trace.ops
        op = ops[i] if 0 <= i < len(ops) else None
        if op is None:
            return self.trace.peak_non_model_bytes
        # traced gradient buffers not live yet (the one being made room for is among the traced ones)
        return op.non_model_bytes + max(0, op.pinned_bytes - self.manager.grad_buffer_bytes - self._new_grad)

    def _align(self, i: int, label: str, chunks: list[Chunk]) -> int:
        """The traced operator whose non-model bytes stand for operator ``i`` of this iteration."""
        ops, ids = self.trace.ops, tuple(c.id for c in chunks)
        if i >= len(ops) or (ops[i].label == label and ops[i].chunk_ids == ids):
            return i
        same = [j for j, op in enumerate(ops) if op.label == label and op.chunk_ids == ids]
        return max(same, key=lambda j: ops[j].non_model_bytes) if same else len(ops)  # unknown: the peak

    @_untracks_on_error
    def _begin_op(self, label: str, chunks: list[Chunk]) -> None:
        with self.tracker.suspended(), events.label("placement"):
            self._op_label = label
            training = torch.is_grad_enabled() or self._in_backward
            i = self.op_index if training else -1
            if training and not self.warmup:
                self._aligned = (i, self._align(i, label, chunks))
            if self.warmup and training:
                self._close_record()
                self.trace.ops.append(OpRecord(label=label, chunk_ids=tuple(c.id for c in chunks)))
                self._record_open = True
            keep = self.prefetcher.keep(i, chunks) if self.prefetcher else frozenset(c.id for c in chunks)
            self.policy.protected = keep
            self.policy.after_op(self._current, keep)
            if self.prefetcher:
                self.prefetcher.enter(keep)
            if self.warmup and training:  # see [Note: held chunks]
                own = {c.id for c in chunks}
                held = [
                    c.id for c in self.manager.chunks if c.id not in own and c.in_use and c.state is ChunkState.GATHERED
                ]
                self.trace.ops[-1].held_chunk_ids = tuple(held)
            self.policy.before_op(i, chunks)
            if self.prefetcher:
                self.prefetcher.issue(i, lambda nbytes, protect: self.policy.make_room(nbytes, protect, i))
            self._current = chunks
            self._op_label = label
            if training:
                self.op_index += 1
            self._sample(label, i)

    def _close_record(self) -> None:
        if self._record_open and self._tracking:
            self._record_open = False
            op = self.trace.ops[-1]
            op.non_model_bytes = max(op.non_model_bytes, self.tracker.peak_bytes)
            op.pinned_bytes = max(op.pinned_bytes, self._pinned)
            need = self._op_model + op.non_model_bytes
            self._peak = [self._peak[0], max(self._peak[1], op.non_model_bytes), max(self._peak[2], need)]
            if need > self.manager.device.budget:
                raise BudgetExceededError(
                    f"need {need} bytes on the device at operator {op.label} (model {self._op_model}, non-model "
                    f"{op.non_model_bytes} measured in warm-up), budget {self.manager.device.budget}; "
                    f"{self.budget_advice()}"
                )
            if self.manager.device.device.type == "cuda":
                op.cuda_non_model_bytes = torch.cuda.memory_allocated() - self.manager.device.used_bytes
            self.tracker.reset_peak()
            self._pinned = self.manager.grad_buffer_bytes
            self._op_model = 0

    def _sample(self, label: str, i: int) -> None:
        model = self.manager.device.used_bytes
        self._op_model = max(self._op_model, model)
        non_model = self.tracker.current() if self.warmup else self._reserve(i)
        self._peak = [max(self._peak[0], model), max(self._peak[1], non_model), max(self._peak[2], model + non_model)]
        if events.has_observers():
            kind = self.manager.device.kind
            events.emit(
                events.MemorySample(
                    time=time.perf_counter(), tier=kind, model_bytes=model, non_model_bytes=non_model, label=label
                )
            )

    # -- backward -------------------------------------------------------------------------------------
    @_untracks_on_error
    def _pre_backward(self, module: nn.Module, grad: torch.Tensor) -> None:
        if self._recomputing:
            self._unpin_recompute()
        if module is self._bwd_module:
            return
        if not self._in_backward:
            self._enter_backward()
        self._leave_backward_op()
        name, chunks, pairs = self._module_chunks[module]
        self._bwd_module = module
        self._begin_op(f"bwd:{name}", chunks)
        for chunk, info in pairs:
            if info.state is not TensorState.COMPUTE:
                chunk.transition(info, TensorState.COMPUTE)
        self._bwd_infos = pairs

    def _enter_backward(self) -> None:
        """First hook of a backward pass (a pre-backward, or a gradient on the resident fast path)."""
        self._in_backward = True
        self._reduced: set[int] = set()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _leave_backward_op(self) -> None:
        for chunk, info in self._bwd_infos:
            if info.state is TensorState.COMPUTE:
                chunk.transition(info, TensorState.HOLD_AFTER_BWD)
        self._bwd_infos = []

    @_untracks_on_error
    def _grad_ready(self, param: nn.Parameter) -> None:
        chunk, info = self.manager.chunk_of[param]
        if not self._in_backward:  # the resident fast path has no pre-backward hooks
            self._enter_backward()
        if self._tracking:  # warm-up: the engine's own buffers are model data
            with self.tracker.suspended():
                self._take_grad(chunk, info, param)
        else:
            self._take_grad(chunk, info, param)
        if self._module_handles and not chunk.in_use:  # kept on the device only for this gradient: see
            self._release_idle([chunk])  # [Note: parent modules] (the resident fast path releases nothing)

    def _take_grad(self, chunk: Chunk, info, param: nn.Parameter) -> None:
        """Move ``param.grad`` into its chunk; reduce the chunk once all its gradients are in."""
        m = self.manager
        if chunk is self._inflight:  # a later part of a shared gradient: the buffer is being reduced
            m.finish_reduce(chunk)
            self._inflight = None
        new_buffer = chunk.grad_buffer is None and not m.direct_grad(chunk)
        if new_buffer:
            self._new_grad = chunk.nbytes
            try:
                self.policy.make_room(chunk.nbytes, {c.id for c in self._current}, self.op_index - 1)
            finally:
                self._new_grad = 0
        m.add_grad(chunk, info, param.grad)
        chunk.got_grad.add(info.offset)
        if new_buffer:
            self._pinned = max(self._pinned, m.grad_buffer_bytes)
            self._sample("grad", self.op_index - 1)
        param.grad = None
        if info.state is TensorState.READY_FOR_REDUCE:  # one more part, its chunk waits in the fixed order
            return
        chunk.transition(info, TensorState.READY_FOR_REDUCE)
        if chunk.ready_for_reduce:
            self._reduce(chunk)

    def _reduce(self, chunk: Chunk) -> None:
        """``chunk``'s gradients are all in: reduce it (replicated chunks: in the fixed order, see
        ``[Note: fixed reduction order]``)."""
        if not self.manager.replicated or chunk.id in self._reduced:  # reduced already: a later part of a
            self._launch_reduce(chunk)  # shared parameter's gradient (see [Note: shared parameters])
            return
        order, chunks = self._reduce_order, self.manager.chunks
        while self._next_reduce < len(order) and chunks[order[self._next_reduce]].ready_for_reduce:
            self._launch_reduce(chunks[order[self._next_reduce]])
            self._next_reduce += 1

    def _launch_reduce(self, chunk: Chunk) -> None:
        m = self.manager
        if self._inflight is not None:  # keep one reduction in flight
            m.finish_reduce(self._inflight)
            self._inflight = None
        self._reduced.add(chunk.id)
        m.reduce(chunk)
        if chunk.pending is None:
            m.finish_reduce(chunk)
        else:
            self._inflight = chunk

    def _reduce_rest(self) -> None:
        """End of backward: reduce every chunk not reduced yet, zeros standing for the gradients this rank
        did not produce (unused parameters, a module skipped on this rank)."""
        m = self.manager
        if self._inflight is not None:  # finished first: its tensors' part counts are reset then
            m.finish_reduce(self._inflight)
            self._inflight = None
        order = self._reduce_order if m.replicated else [c.id for c in m.trainable]
        for c in m.chunks:
            if c.frozen:  # no gradient to reduce: its tensors just leave the backward ([Note: frozen chunks])
                c.after_frozen_backward()
        for c in (m.chunks[i] for i in order):
            if c.id in self._reduced and not any(info.grads for info in c.tensors):
                continue  # reduced, and no part of a shared gradient came after (see [Note: shared parameters])
            for info in c.tensors:
                if info.state is not TensorState.READY_FOR_REDUCE:
                    c.transition(info, TensorState.READY_FOR_REDUCE)
            self._launch_reduce(c)
        if self._inflight is not None:
            m.finish_reduce(self._inflight)
            self._inflight = None
        self._next_reduce = 0

    def _backward_end(self) -> None:
        self._unpin_recompute()
        quiet = self.tracker.suspended() if self._tracking else contextlib.nullcontext()
        with quiet:
            self._leave_backward_op()
            if not self._native:  # native: nothing to reduce, the gradients stay in param.grad
                self._reduce_rest()
            if self._module_handles:  # also chunks a gradient arrived late for (nothing to do when resident)
                self.policy.after_op(self.manager.chunks, set())
            if self.prefetcher:
                self.prefetcher.enter(frozenset())
            self.policy.protected = frozenset()
            if self.warmup:
                self._close_record()
            self._current = []
            self._bwd_module = None
            self._in_backward = False

    # -- iteration end (called by GeminiOptimizer.step) -------------------------------------------------
    def end_iteration(self, optimizer_blocks: Callable | None = None) -> GeminiStats:
        """Close the step: finish warm-up if needed, record and publish its statistics."""
        if self.warmup:
            self._close_record()
            if self._tracking:
                self.tracker.__exit__(None, None, None)
                self._tracking = False
            if optimizer_blocks is not None:
                finish_warmup(self, optimizer_blocks)
                self.plan_fast_path()
            else:  # skipped step (overflow): trace the next iteration afresh
                self._fresh_trace()
        m = self.manager
        rss, rss_peak = rss_and_peak_bytes()
        stats = GeminiStats(
            step=len(self.stats_history),
            policy=self.policy.name if not self.warmup else "warmup",
            bytes_to_device=m.traffic.to_device,
            bytes_to_host=m.traffic.to_host,
            transfer_seconds=m.traffic.seconds,
            peak_model_bytes=self._peak[0],
            peak_non_model_bytes=self._peak[1],
            peak_device_bytes=self._peak[2],
            budget=m.device.budget,
            chunks_on_device=m.chunks_on("device"),
            chunks_on_host=m.chunks_on("host"),
            optim_on_device=sum(c.o_tier == "device" for c in m.chunks),
            belady_bytes=self.belady_bytes,
            host_rss_bytes=rss,
            host_rss_peak_bytes=rss_peak,
            **self._disk_stats(),
        )
        self.stats_history.append(stats)
        m.traffic.to_device = m.traffic.to_host = 0
        m.traffic.seconds = 0.0
        self._reset_iteration()
        return stats

    def _disk_stats(self) -> dict:
        disk = self.manager.disk
        if disk is None:
            return {}
        from colossal.gemini.disk import settle

        for c in self.manager.chunks:  # reads ahead into the next step finish in this one's count
            settle(self.manager, c)
        disk.drain()
        now = disk.counters()
        last = getattr(self, "_disk_last", (0, 0, 0.0))
        self._disk_last = now
        return dict(
            disk_bytes_read=now[0] - last[0],
            disk_bytes_written=now[1] - last[1],
            disk_wait_seconds=now[2] - last[2],
            belady_disk_bytes=getattr(self, "belady_disk_bytes", None),
            host_peak_bytes=self.manager.host.peak_bytes,
        )

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Full fp32 state of the wrapped module (gathered; loads into the plain module).
        Collective (an all-gather per chunk): call on every rank, not only on the one that writes."""
        return checkpoint.model_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state of the wrapped module (from :meth:`state_dict` or the plain module),
        strict like ``torch.nn.Module.load_state_dict``; every rank calls it with the full dict.
        Returns torch's ``_IncompatibleKeys``."""
        return checkpoint.load_model_state_dict(self, state_dict, strict)

    @property
    def stats(self) -> GeminiStats | None:
        """Statistics of the last finished step."""
        return self.stats_history[-1] if self.stats_history else None


class _Saved:
    """A parameter view autograd saved for backward; counted in ``Chunk.saved`` while alive."""

    __slots__ = ("tensor", "chunk")

    def __init__(self, tensor: torch.Tensor, chunk: Chunk):
        self.tensor, self.chunk = tensor, chunk
        chunk.saved += 1

    def __del__(self):
        self.chunk.saved -= 1


_RUNTIME = frozenset(
    {
        "op_index",
        "_current",
        "_bwd_infos",
        "_bwd_module",
        "_in_backward",
        "_recomputing",
        "_aligned",
        "_new_grad",
        "_peak",
        "_pinned",
        "_tracking",
        "_record_open",
        "_op_model",
        "_op_label",
        "_reduced",
        "_next_reduce",
        "_inflight",
        "_native",
        "_handles",
        "warmup",
        "belady_bytes",
        "belady_disk_bytes",
        "_disk_last",
        "policy",
        "prefetcher",
        "trace",
        "tracker",
    }
)
