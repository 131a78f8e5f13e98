"""Activations and gradients between neighbouring chunks, through ``colossal.comm.batch_p2p``.

[Note: shapes agreed once]
The receiver of an activation must allocate its buffer before the data arrives. The first time a
chunk boundary is crossed for a given input signature (shape and dtype of the user's batch and
the micro-batch count), the sender puts a small int64 header (dtype code, rank, dims) in front of
the data; the receiver reads it, allocates, and remembers the result. Every later micro-batch and
step with the same signature receives straight into a fresh buffer, posted ahead of time.
Gradients need no header: the gradient of a chunk's output has the output's shape, which the
receiving rank produced itself.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from colossal import comm as cc
from colossal.pipeline.schedules import Action, ActionKind, Schedule

__all__ = ["StageLinks", "P2P_TAG", "HEADER_TAG"]

P2P_TAG = "colossal.pipeline.p2p"
"""Tag of every activation/gradient transfer's :class:`~colossal.comm.CommEvent`."""
HEADER_TAG = "colossal.pipeline.shape"
"""Tag of the shape headers (first step of a signature only)."""

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


class _Pending:
    """A posted receive: either the data itself, or first a header (shape not yet known)."""

    def __init__(self, action: Action, handle, buf: torch.Tensor, is_header: bool) -> None:
        self.action, self.handle, self.buf, self.is_header = action, handle, buf, is_header


class StageLinks:
    """The transfers of one rank: posts receives, issues sends, learns shapes once."""

    def __init__(self, group: ProcessGroup | None, schedule: Schedule, device: torch.device) -> None:
        self.group, self.schedule, self.device = group, schedule, device
        self._in_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}  # chunk -> its input's shape, dtype
        self._out_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}  # chunk -> its output's shape, dtype
        self._told: set[int] = set()  # chunks whose output header was sent under this signature
        self._signature: object = None
        self._sends: list = []

    def set_signature(self, signature: object) -> bool:
        """Start a step; forget the shapes when ``signature`` changed. Returns whether they are known."""
        if signature != self._signature:
            self._in_meta.clear()
            self._out_meta.clear()
            self._told.clear()
            self._signature = signature
            return False
        return True

    def note_output(self, chunk: int, out: torch.Tensor) -> None:
        """Remember the shape of ``chunk``'s output (the shape of the gradient it will receive)."""
        self._out_meta[chunk] = (out.shape, out.dtype)

    def known(self, a: Action) -> bool:
        """Whether the receive ``a`` can be posted without a header."""
        return a.chunk in (self._in_meta if a.kind == ActionKind.RECV_F else self._out_meta)

    def _peer(self, a: Action) -> int:
        step = 1 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else -1
        return self.schedule.rank_of(a.chunk + step)

    def _recv(self, buf: torch.Tensor, peer: int, tag: str):
        return cc.batch_p2p([cc.P2POp("recv", buf, peer, self.group)], async_op=True, tag=tag)

    def post_recv(self, a: Action) -> _Pending:
        """Post the receive of ``a`` now (a header first when the shape is not known yet)."""
        peer = self._peer(a)
        if not self.known(a):
            if a.kind != ActionKind.RECV_F:
                raise RuntimeError(f"{a}: gradient shape unknown before the forward of chunk {a.chunk}")
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
            return _Pending(a, self._recv(header, peer, HEADER_TAG), header, True)
        shape, dtype = (self._in_meta if a.kind == ActionKind.RECV_F else self._out_meta)[a.chunk]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return _Pending(a, self._recv(buf, peer, P2P_TAG), buf, False)

    def wait(self, pending: _Pending) -> torch.Tensor:
        """Block until the received tensor of ``pending`` is there; return it."""
        pending.handle.wait()
        if pending.is_header:
            code, ndim, *dims = pending.buf.tolist()
            self._in_meta[pending.action.chunk] = (torch.Size(dims[:ndim]), _DTYPES[code])
            return self.wait(self.post_recv(pending.action))
        return pending.buf

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Issue the send of ``a`` (asynchronous; completed by :meth:`wait_sends`)."""
        peer, tensor = self._peer(a), tensor.contiguous()
        if a.kind == ActionKind.SEND_F and a.chunk not in self._told:
            if tensor.dtype not in _DTYPES or tensor.dim() > _HEADER_LEN - 2:
                raise TypeError(
                    f"chunk {a.chunk} output must be a tensor of <= 8 dims and dtype in {_DTYPES}, "
                    f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
                )
            dims = list(tensor.shape) + [0] * (_HEADER_LEN - 2 - tensor.dim())
            header = torch.tensor(
                [_DTYPES.index(tensor.dtype), tensor.dim(), *dims], dtype=torch.int64, device=self.device
            )
            self._sends.append(
                cc.batch_p2p([cc.P2POp("send", header, peer, self.group)], async_op=True, tag=HEADER_TAG)
            )
            self._told.add(a.chunk)
        self._sends.append(cc.batch_p2p([cc.P2POp("send", tensor, peer, self.group)], async_op=True, tag=P2P_TAG))

    def wait_sends(self) -> None:
        """Complete every send issued since the last call."""
        for h in self._sends:
            h.wait()
        self._sends.clear()
