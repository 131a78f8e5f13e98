"""Gradient reduction from backward hooks: accumulate each parameter's gradient into its flat
buffer, reduce-scatter a buffer as soon as all its gradients are in (overlapping the rest of
backward), and flush what is left at the end of backward.

[Note: reduction order and unused parameters]
Collectives must be issued in the same order on every rank, but which buffer completes first
can differ (data-dependent control flow, unused parameters). Like DDP, buffers are launched in a
fixed index order: a completed buffer waits until every buffer before it has been launched. At
the end of backward (an autograd engine callback queued by the first hook of the pass) every
buffer not yet launched is launched, with zeros for parameters that got no gradient, so no rank
waits for a gradient that never comes.

[Note: accumulating across backward passes]
Stage 2/3 keep ``shard_grad``, the running sum over ranks and backward passes of this rank's
slice. Stage 1 keeps a persistent full ``full_grad`` (the paper's P_os does not partition
gradients); after each reduce-scatter its owned slice holds the reduced sum and the rest is
zeroed, so the next reduce-scatter adds the new local gradients to that sum exactly once.
With a replicate group (HSDP) that trick would count the earlier sum once per replica in the
replicate all-reduce, so there stage 1 keeps the sum in ``shard_grad`` as stage 2 does (Psi/N
more gradient memory, from the first reduction to ``zero_grad``) and zeroes all of ``full_grad``.
Gradients are summed, not averaged: the step divides by the data-parallel size once.

[Note: gradients as buffer views]
As DDP's ``gradient_as_bucket_view``: once a buffer's flat gradient exists, every parameter's
``.grad`` is a view of its slot, and autograd's ``AccumulateGrad`` adds into a defined ``.grad``
in place. Only a gradient that arrives before its buffer exists (the first of a stage-2 bucket
in a pass) is copied. This saves a copy per parameter and, more importantly on the CPU, the
allocation and freeing of every parameter's gradient each step (heap churn that shows as RSS).
Stage 2/3 drop the views with the buffer after its reduce-scatter.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
from torch.autograd import Variable
from torch.distributed import ProcessGroup

from colossal.comm import all_reduce, reduce_scatter, weak_hook
from colossal.zero._flat_param import FlatParam

__all__ = ["GradReducer"]


class GradReducer:
    """Owns the gradient hooks of a list of :class:`FlatParam` (launch order = list order)."""

    def __init__(
        self,
        flats: list[FlatParam],
        group: ProcessGroup | None,
        replicate_group: ProcessGroup | None,
        keep_full_grad: bool,
        max_inflight: int,
    ):
        self.flats = [f for f in flats if f.trainable]
        self.group, self.replicate_group = group, replicate_group
        self.keep_full_grad = keep_full_grad
        # Stage 1 keeps the reduced sum in the owned slice of full_grad, except with replicas:
        # the replicate all-reduce would add that sum once per replica on the next reduction.
        self._sum_in_full_grad = keep_full_grad and replicate_group is None
        self.max_inflight = max_inflight
        self.sync = True
        """False inside ``no_sync()``: gradients accumulate locally, nothing is communicated."""
        self.on_complete: Callable[[FlatParam], None] | None = None
        """Called when every trainable parameter of a buffer has its gradient (stage 3 frees)."""
        self.on_backward_end: Callable[[], None] | None = None
        self._next = 0  # index of the next buffer to launch in this backward
        self._inflight: collections.deque = collections.deque()
        self._callback_queued = False
        self._hooks = []
        for k, flat in enumerate(self.flats):
            self._init_buffers(flat)
            for i in flat.trainable:  # weak: [Note: weak hooks] in colossal.comm.hooks
                hook = weak_hook(self._on_grad_at, k, i)
                self._hooks.append(flat.params[i].register_post_accumulate_grad_hook(hook))

    def _init_buffers(self, flat: FlatParam) -> None:
        p = flat.params[0]
        dtype, device = (flat.full.dtype, flat.full.device) if flat.full is not None else (p.dtype, p.device)
        if flat.shard is not None:
            dtype = flat.shard.dtype
        flat.grad_dtype, flat.grad_device = dtype, device
        if self.keep_full_grad:
            self._new_full_grad(flat, torch.empty(0, dtype=dtype, device=device))

    def sharded_grad(self, flat: FlatParam) -> torch.Tensor:
        """This rank's slice of the reduced (summed) gradient of ``flat``, ``(shard_numel,)``."""
        if self._sum_in_full_grad:
            return flat.local(flat.full_grad)
        if flat.shard_grad is None:  # a step without any backward since the last zero_grad
            flat.shard_grad = torch.zeros(flat.shard_numel, dtype=flat.grad_dtype, device=flat.grad_device)
        return flat.shard_grad

    def ensure_callback(self) -> None:
        """Queue the end-of-backward flush once per backward pass (call from inside a hook)."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad_at(self, k: int, index: int, param: torch.Tensor) -> None:
        self._on_grad(self.flats[k], index, param)

    def _on_grad(self, flat: FlatParam, index: int, param: torch.Tensor) -> None:
        self.ensure_callback()
        grad = param.grad
        views = self._new_full_grad(flat, grad) if flat.full_grad is None else None
        full = flat.full_grad
        # Is ``.grad`` still our slot? A pointer compare, no view made: the common case dispatches no
        # operator at all (one slice and one view per parameter and step before).
        if grad.data_ptr() != full.data_ptr() + flat.offsets[index] * full.element_size():
            # autograd made a fresh tensor (the user dropped ours, e.g. model.zero_grad()): fold it in,
            # and hand every parameter without a .grad its slot again, so the rest accumulate in place
            views = flat.grad_views() if views is None else views
            views[index].add_(grad)
            param.grad = views[index]
            self._hand_out_slots(flat, views)
        flat.ready.add(index)
        flat.got_grad.add(index)
        if len(flat.ready) == len(flat.trainable):
            if self.on_complete is not None:
                self.on_complete(flat)
            if self.sync:
                self._launch_completed()

    def _new_full_grad(self, flat: FlatParam, like: torch.Tensor) -> list[torch.Tensor]:
        """Allocate the flat gradient buffer and make every parameter's ``.grad`` a view of it, so
        autograd accumulates in place (no per-parameter gradient tensors, no copies; see the
        [Note: gradients as buffer views]). Returns the views."""
        flat.full_grad = torch.zeros(flat.padded_numel, dtype=like.dtype, device=like.device)
        views = flat.grad_views()
        self._hand_out_slots(flat, views)
        return views

    @staticmethod
    def _hand_out_slots(flat: FlatParam, views: list[torch.Tensor]) -> None:
        """Point every trainable parameter without a ``.grad`` at its slot of the buffer."""
        for i in flat.trainable:
            if flat.params[i].grad is None:
                flat.params[i].grad = views[i]

    def _launch_completed(self) -> None:
        while self._next < len(self.flats) and len(self.flats[self._next].ready) == len(
            self.flats[self._next].trainable
        ):
            self._start(self.flats[self._next])
            self._next += 1

    def _start(self, flat: FlatParam) -> None:
        if flat.full_grad is None:  # no parameter of this buffer got a gradient
            flat.full_grad = torch.zeros(flat.padded_numel, dtype=flat.grad_dtype, device=flat.grad_device)
        with torch.profiler.record_function("colossal.zero::reduce_scatter"):
            handle = reduce_scatter(
                flat.full_grad, "sum", self.group, async_op=True, tag="zero.reduce_scatter_grad", destroy_input=True
            )
        self._inflight.append((flat, handle))
        while len(self._inflight) > self.max_inflight:
            self._finish(*self._inflight.popleft())

    def _finish(self, flat: FlatParam, handle) -> None:
        out = handle.wait()  # (shard_numel,) sum over the shard group
        if self.replicate_group is not None:
            all_reduce(out, "sum", self.replicate_group, tag="zero.all_reduce_replicate_grad")
        if self._sum_in_full_grad:
            full = flat.full_grad
            full.zero_()
            flat.local(full).copy_(out)
        else:  # the shard exists from the first reduction of a step until zero_grad (as FSDP2's)
            flat.shard_grad = out if flat.shard_grad is None else flat.shard_grad.add_(out)
            if self.keep_full_grad:
                flat.full_grad.zero_()  # stage 1 with replicas: see [Note: accumulating across backward passes]
            else:
                self._drop_full_grad(flat)

    def _drop_full_grad(self, flat: FlatParam) -> None:
        for p in flat.params:
            p.grad = None  # the views would keep the buffer alive
        flat.full_grad = None

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.sync:
            for flat in self.flats[self._next :]:
                self._start(flat)
            self.wait_all()
            self._next = 0
        for flat in self.flats:
            flat.ready.clear()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def wait_all(self) -> None:
        """Finish every reduction in flight."""
        while self._inflight:
            self._finish(*self._inflight.popleft())

    def zero_grad(self) -> None:
        """Forget all accumulated gradients (after a step or a skipped step)."""
        for flat in self.flats:
            flat.shard_grad = None
            flat.got_grad.clear()
            if self.keep_full_grad:
                flat.full_grad.zero_()
            else:
                self._drop_full_grad(flat)

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
