"""Flat (contiguous) storage for one parameter group's CPU parameters of one dtype.

[Note: why flatten]
torch's fused CPU Adam kernel parallelises *within* each tensor, so a model of a few hundred
tensors pays a parallel region (thread wake-up and barrier) per tensor, which costs a lot more
than the arithmetic on a busy or small machine. A :class:`FlatSpace` moves the parameters of one
group and dtype into one buffer (``p.data`` becomes a view of it, the ``Parameter`` objects stay
the same), keeps the moments (and fp32 master weights) in flat buffers whose per-parameter views
are what ``optimizer.state`` holds, and re-points ``p.grad`` at views of a flat gradient buffer.
A step is then one fused-kernel call over the whole buffer. Gradients produced elsewhere (the
first backward, or after ``zero_grad(set_to_none=True)``) are copied into the flat buffer once;
after ``zero_grad(set_to_none=False)`` autograd accumulates straight into it and nothing is
copied.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["FlatSpace", "flattenable", "ADAM_MOMENTS"]

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


# [Note: whose storage may be moved]
# Flattening re-points ``p.data`` into a new buffer. That is safe for a tensor alone in its
# storage, and for one already inside a flat buffer of ours (a rebuild), but never for a view
# into someone else's buffer (ZeRO/Gemini master shards, which must keep receiving the updates),
# even a view that spans all of it (``_base`` set). Our buffers are remembered by their storage
# objects (weakly, by identity: torch keeps one Python object per live storage), not by address:
# a freed buffer's address is soon reused by an unrelated allocation.
_OWN_STORAGES: dict[int, weakref.ref] = {}  # data_ptr -> storage of a FlatSpace parameter buffer


def _remember_storage(buf: Tensor) -> None:
    for ptr in [k for k, ref in _OWN_STORAGES.items() if ref() is None]:
        del _OWN_STORAGES[ptr]
    storage = buf.untyped_storage()
    _OWN_STORAGES[storage.data_ptr()] = weakref.ref(storage)


def in_flat_buffer(p: Tensor) -> bool:
    """``p`` lives in the parameter buffer of a (live) :class:`FlatSpace`."""
    storage = p.untyped_storage()
    ref = _OWN_STORAGES.get(storage.data_ptr())
    return ref is not None and ref() is storage


def flattenable(p: Tensor) -> bool:
    """A dense, contiguous, real floating-point CPU tensor whose storage it may be moved out of
    (see ``[Note: whose storage may be moved]``)."""
    if not (p.device.type == "cpu" and p.layout == torch.strided and p.is_contiguous() and p.is_floating_point()):
        return False
    alone = p._base is None and p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    return alone or in_flat_buffer(p)


class FlatSpace:
    """Parameters (same group, device and dtype) laid out in flat buffers; see ``[Note: why flatten]``.

    Args:
        params: the parameters, all of one dtype.
        state: the optimizer's ``state`` mapping; existing entries are copied in, then replaced by views.
        master_dtype: dtype of the moments and of the master weights (the params' dtype: none kept).
        align: every parameter starts at a multiple of ``align`` elements; the gaps (and the tail up
            to a multiple of ``align``) stay zero in every buffer, so ``buffer.view(-1, align)`` rows
            each belong to one parameter (see :class:`colossal.optim._segments.Segments`).
        moments: the state keys kept in flat buffers (zero-initialised, master dtype).
        step: keep a ``state["step"]`` tensor per parameter (the Adam family).
    """

    def __init__(
        self,
        params: list[Tensor],
        state: dict[Tensor, dict[str, Any]],
        master_dtype: torch.dtype,
        *,
        align: int = 1,
        moments: tuple[str, ...] = ADAM_MOMENTS,
        step: bool = True,
    ) -> None:
        self.params, self.align, self._step = params, align, step
        dtype = params[0].dtype
        sizes = [p.numel() for p in params]
        self._slices, offset = [], 0
        for n in sizes:
            self._slices.append(slice(offset, offset + n))
            offset += -(-n // align) * align
        total, self.padded = offset, offset != sum(sizes)
        self.param_flat = torch.zeros(total, dtype=dtype)  # (N,) working weights
        _remember_storage(self.param_flat)
        self.grad_flat = torch.zeros(total, dtype=dtype)  # (N,) gradients, param dtype
        self.has_master = master_dtype != dtype
        self.master_flat = torch.zeros(total, dtype=master_dtype) if self.has_master else self.param_flat
        self.grad_master = torch.zeros(total, dtype=master_dtype) if self.has_master else self.grad_flat
        self.moments = {key: torch.zeros(total, dtype=master_dtype) for key in moments}
        for p, sl in zip(params, self._slices):
            self._adopt(p, sl, state.setdefault(p, {}))
        self._param_ptrs = [self.param_flat[sl].data_ptr() for sl in self._slices]
        self._grad_views = [self.grad_flat[sl] for sl in self._slices]

    @property
    def exp_avg(self) -> Tensor:
        """The flat first moment (Adam family)."""
        return self.moments["exp_avg"]

    @property
    def exp_avg_sq(self) -> Tensor:
        """The flat second moment (Adam family)."""
        return self.moments["exp_avg_sq"]

    @property
    def slices(self) -> list[slice]:
        """Each parameter's elements in the flat buffers."""
        return self._slices

    def _adopt(self, p: Tensor, sl: slice, st: dict[str, Any]) -> None:
        view = self.param_flat[sl].view_as(p)
        view.copy_(p.detach())
        p.data = view
        if p.grad is not None:
            self.grad_flat[sl].view_as(p).copy_(p.grad)
            p.grad = self.grad_flat[sl].view_as(p)
        if self.has_master:
            master = self.master_flat[sl].view_as(p)
            master.copy_(st["master"] if "master" in st else p.detach())
            st["master"] = master
        for key, flat in self.moments.items():
            view = flat[sl].view_as(p)
            if key in st:
                view.copy_(st[key])
            st[key] = view
        if self._step:
            st.setdefault("step", torch.zeros((), dtype=torch.float32))

    def intact(self) -> bool:
        """Whether every parameter still lives in ``param_flat`` (``p.data = ...`` or ``.to()`` moves it out)."""
        dtype = self.param_flat.dtype
        return all(p.data_ptr() == ptr and p.dtype == dtype for p, ptr in zip(self.params, self._param_ptrs))

    def gather_grads(self) -> None:
        """Make every ``p.grad`` a view of ``grad_flat`` (copying foreign ones in); fill ``grad_master``."""
        views = self._grad_views
        foreign = [i for i, (p, v) in enumerate(zip(self.params, views)) if p.grad.data_ptr() != v.data_ptr()]
        if len(foreign) == len(views) > 1 and not self.padded:  # after zero_grad(set_to_none=True)
            torch.cat([p.grad.reshape(-1) for p in self.params], out=self.grad_flat)
        elif foreign:
            torch._foreach_copy_([views[i] for i in foreign], [self.params[i].grad.reshape(-1) for i in foreign])
        for i in foreign:
            self.params[i].grad = views[i].view_as(self.params[i])
        if self.has_master:
            self.grad_master.copy_(self.grad_flat)

    def publish(self) -> None:
        """Copy the master weights into the working copies (one cast over the whole buffer)."""
        if self.has_master:
            self.param_flat.copy_(self.master_flat)
