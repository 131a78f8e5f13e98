"""The pipeline runtime: build this rank's chunks, then run a schedule's actions each step.

    pipe = PipelineParallel(model, PipelineConfig(num_microbatches=8, schedule="1f1b"), group=pp_group)
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(idx, targets, F.cross_entropy)   # the same value on every rank
    opt.step(); opt.zero_grad()

[Note: exact gradient accumulation]
The batch is cut into ``m`` equal micro-batches; the last chunk computes ``loss_fn`` on each and
backpropagates ``loss / m`` (``loss_reduction="mean"``) or ``loss`` (``"sum"``), so the gradients
autograd accumulates into ``.grad`` over the micro-batches are those of the whole batch's loss
(``mean`` of equal-size means is the mean). Gradients already in ``.grad`` are kept and added to,
as ``loss.backward()`` does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal import comm as cc
from colossal.pipeline.p2p import StageLinks, exchange_blocks, send_release_points
from colossal.pipeline.schedules import Action, ActionKind, Schedule, get_schedule
from colossal.pipeline.simulate import grouping_for
from colossal.pipeline.stages import (
    BlockCost,
    find_blocks,
    materialize_owned,
    partition_blocks,
    split_model,
    tensor_owners,
)
from colossal.pipeline.weight_grad import WeightGradStore

__all__ = ["PipelineConfig", "PipelineParallel", "StepStats", "TIED_TAG", "LOSS_TAG", "stage_tensor_names"]

TIED_TAG = "colossal.pipeline.tied"
"""Tag of the tied-embedding gradient exchange (and the setup copy)."""
LOSS_TAG = "colossal.pipeline.loss"
"""Tag of the loss broadcast from the last stage."""
_K = ActionKind


@dataclasses.dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """How to split the model and run the pipeline."""

    num_microbatches: int
    """Micro-batches per step ``m``; the batch size must divide by it."""
    schedule: str | Schedule = "1f1b"
    """``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zero_bubble"`` (ZB-H1)."""
    virtual: int = 1
    """Chunks per rank ``v`` (only ``"interleaved"`` takes more than one)."""
    blocks: str | None = None
    """Dotted name of the block sequence (``nn.ModuleList``/``nn.Sequential``); ``None``: look for
    the usual names (``blocks``, ``layers``, ``h``, ``transformer.h``, ...)."""
    partition: str = "uniform"
    """``"uniform"`` (equal block counts), ``"params"`` (balance parameter counts), ``"cost"``
    (balance ``costs``) or ``"sizes"`` (``sizes`` given)."""
    sizes: Sequence[int] | None = None
    """Blocks per chunk for ``partition="sizes"`` (``p * v`` counts)."""
    costs: Sequence[float | BlockCost] | None = None
    """Per-block cost for ``partition="cost"``: numbers, or :class:`BlockCost` from
    :func:`~colossal.pipeline.measure_block_costs` (their forward time is balanced)."""
    activation_checkpointing: bool = False
    """Recompute each block's forward during its backward (non-reentrant checkpointing)."""
    loss_reduction: str = "mean"
    """``"mean"``: the step's loss is the mean of the micro-batch losses; ``"sum"``: their sum."""
    p2p: str = "auto"
    """How transfers are issued (``[Note: p2p order on NCCL]`` in :mod:`colossal.pipeline.p2p`):
    ``"overlap"`` (each operation on its own, receives posted one compute ahead: gloo only),
    ``"grouped"`` (one ordered ``batch_p2p`` per exchange point: what NCCL needs), or ``"auto"``
    (overlap on gloo, grouped on every other backend)."""

    def __post_init__(self) -> None:
        m = self.num_microbatches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
        if not isinstance(self.virtual, int) or self.virtual < 1:
            raise ValueError(f"virtual must be a positive int, got {self.virtual!r}")
        if self.partition not in ("uniform", "params", "cost", "sizes"):
            raise ValueError(f"partition must be 'uniform', 'params', 'cost' or 'sizes', got {self.partition!r}")
        if (self.partition == "sizes") != (self.sizes is not None):
            raise ValueError(f"sizes={self.sizes!r} goes with partition='sizes' (got partition={self.partition!r})")
        if (self.partition == "cost") != (self.costs is not None):
            raise ValueError(f"costs goes with partition='cost' (got partition={self.partition!r})")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.p2p not in ("auto", "overlap", "grouped"):
            raise ValueError(f"p2p must be 'auto', 'overlap' or 'grouped', got {self.p2p!r}")


@dataclasses.dataclass(slots=True)
class StepStats:
    """What the last :meth:`PipelineParallel.step` did on this rank."""

    wall_s: float = 0.0
    """Seconds from the start of the step to the loss being known on this rank."""
    compute_s: float = 0.0
    """Seconds spent in forward/backward compute (the rest is waiting or communication)."""
    peak_inflight: int = 0
    """Most (micro-batch, chunk) activations held at once."""
    peak_sends: int = 0
    """Most sends issued and not completed at once (their tensors are held; ``"overlap"`` mode)."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the step: ``1 - compute_s / wall_s``."""
        return 1.0 - self.compute_s / self.wall_s if self.wall_s else 0.0


class _Step:
    """One compute action with the receives it consumes and the sends it produces."""

    __slots__ = ("recvs", "compute", "sends")

    def __init__(self) -> None:
        self.recvs: list[Action] = []
        self.compute: Action | None = None
        self.sends: list[Action] = []


def _group_steps(actions: Iterator[Action]) -> list[_Step]:
    steps, cur = [], _Step()
    for a in actions:
        if a.kind in (_K.RECV_F, _K.RECV_B):
            if cur.compute is not None:
                steps.append(cur)
                cur = _Step()
            cur.recvs.append(a)
        elif a.kind in (_K.SEND_F, _K.SEND_B):
            cur.sends.append(a)
        else:
            if cur.compute is not None:
                steps.append(cur)
                cur = _Step()
            cur.compute = a
    if cur.compute is not None:
        steps.append(cur)
    return steps


class PipelineParallel:
    """This rank's part of a pipeline-parallel model and the executor of its schedule.

    Args:
        model: the whole model, built normally or on the meta device. Its tensors not used by this
            rank's chunks are replaced by meta tensors; the rest are moved to ``device`` (meta ones
            allocated and initialised by ``init(module)``, default: the values a dense build's
            ``reset_parameters()`` calls give them, ``[Note: same initial values as a dense build]``).
        config: :class:`PipelineConfig`.
        group: the pipeline process group (``None``: the default group); its size is ``p``.
        embed: ``embed(model, inputs) -> hidden`` run by the first chunk (default: the model's
            children registered before the blocks, applied in order).
        head: ``head(model, hidden) -> outputs`` run by the last chunk (default: the children
            registered after the blocks).
        device: where this rank's tensors live (default: ``colossal.comm.default_device()``).
        init: initialiser for modules whose tensors were on the meta device.
        block_call: ``block_call(block, x, extras) -> x`` runs one block in a step given
            ``extras`` (``[Note: per-micro-batch extras]`` in :mod:`colossal.pipeline.stages`;
            default ``block(x)``).

    Every check that can fail (block sequence, partition, schedule) runs before any communication,
    so a bad configuration raises the same ``ValueError`` on every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        config: PipelineConfig,
        group: ProcessGroup | None = None,
        *,
        embed: Callable | None = None,
        head: Callable | None = None,
        device: torch.device | str | None = None,
        init: Callable[[nn.Module], None] | None = None,
        block_call: Callable[[nn.Module, torch.Tensor, dict], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
        self.model, self.config, self.group = model, config, group
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.schedule = get_schedule(config.schedule, self.p, config.num_microbatches, config.virtual)
        self.blocks_name, seq = find_blocks(model, config.blocks)
        self.bounds = _partition(model, config, self.blocks_name, self.schedule.n_chunks, len(seq))
        chunk_ids = [self.rank + k * self.p for k in range(self.schedule.v)]
        owners = tensor_owners(model, self.blocks_name)
        tied = _tied_names(model, owners)
        self.chunks = split_model(
            model, chunk_ids, self.bounds, blocks=self.blocks_name, embed=embed, head=head,
            activation_checkpointing=config.activation_checkpointing, block_call=block_call,
        )  # fmt: skip
        self._steps = _group_steps(self.schedule.actions(self.rank))
        backend = dist.get_backend(group)
        self.p2p_mode = config.p2p if config.p2p != "auto" else ("overlap" if backend == "gloo" else "grouped")
        """``"overlap"`` or ``"grouped"``: how this rank issues its transfers (``PipelineConfig.p2p``)."""
        if self.p2p_mode == "grouped":  # verified deadlock-free and order-consistent before any transfer
            paired = grouping_for(self.schedule)
            self._blocks = exchange_blocks([st.compute.kind for st in self._steps], paired)
        else:  # per step, the sends known received by then ([Note: releasing sends on gloo] in p2p)
            self._release = send_release_points(self.schedule, self.rank)
        # --- nothing above communicates; every configuration error has been raised on every rank ---
        self.device = torch.device(device) if device is not None else cc.default_device()
        owned = {n for c in self.chunks for n in c.param_names}
        materialize_owned(model, owned, self.device, init)
        self._named = _unique_params(model, owned)
        self._tied = self._tied_links(tied, owned)
        self._sync_tied()
        self.weight_store = WeightGradStore() if self.schedule.split_backward else None
        if self.weight_store is not None:
            for name in sorted({n.rpartition(".")[0] for n in owned}):  # the Linear layers this rank owns
                if isinstance(owner := model.get_submodule(name), nn.Linear):
                    self.weight_store.patch(owner, prefix=name)
        self.links = StageLinks(group, self.schedule, self.device)
        self.stats = StepStats()

    # --- setup -------------------------------------------------------------------------------------

    def _tied_links(self, tied: list[tuple[str, str]], owned: set[str]) -> list[tuple[str, int]]:
        """(name held here, peer rank) of each tied tensor whose two users live on two ranks."""
        if self.p == 1:
            return []
        links = []
        for first_name, last_name in tied:
            if first_name in owned and self.rank == 0:
                links.append((first_name, self.p - 1))
            if last_name in owned and self.rank == self.p - 1:
                links.append((last_name, 0))
        return links

    @torch.no_grad()
    def _sync_tied(self) -> None:
        """Make the last stage's copy of each tied weight equal to the first stage's."""
        for name, peer in self._tied:
            t = self._named[name]
            kind = "send" if self.rank == 0 else "recv"
            cc.batch_p2p([cc.P2POp(kind, t.data, peer, self.group)], tag=TIED_TAG)

    # --- the parameters this rank holds --------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the whole model (a tied one once per rank)."""
        yield from self._named.items()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (give these to the optimizer)."""
        yield from self._named.values()

    @property
    def tied_names(self) -> list[str]:
        """Names of this rank's parameters that are one of the two copies of a tied weight (held
        by the first and the last stage; their gradients are summed over the two every step)."""
        return [name for name, _ in self._tied]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under their original names."""
        owned = {n for c in self.chunks for n in c.param_names}
        return {k: v for k, v in self.model.state_dict(keep_vars=False).items() if k in owned}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy this rank's entries of a whole-model ``state_dict`` (extra entries are ignored;
        with ``strict``, one missing or mis-shaped entry of this rank raises before any copy)."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        shaped = [
            f"{k}: {tuple(state_dict[k].shape)} vs {tuple(v.shape)}"
            for k, v in mine.items()
            if k in state_dict and state_dict[k].shape != v.shape
        ]
        if strict and (missing or shaped):
            raise ValueError(f"state_dict does not fit this stage: missing {missing}, mis-shaped {shaped}")
        live = dict(self.model.named_parameters(remove_duplicate=False))
        live.update(self.model.named_buffers(remove_duplicate=False))
        for k in mine:
            if k in state_dict:
                live[k].copy_(state_dict[k])

    # --- one step ------------------------------------------------------------------------------------

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor | None, extras: dict | None) -> None:
        m = self.schedule.m
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() == 0 or inputs.shape[0] % m:
            raise ValueError(
                f"batch of {tuple(inputs.shape)[:1] or 'a scalar'} samples is not divisible into "
                f"num_microbatches={m} micro-batches"
            )
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape[:1] != inputs.shape[:1]):
            raise ValueError(
                f"targets must be a tensor with the batch's {inputs.shape[0]} rows, got "
                f"{getattr(targets, 'shape', type(targets).__name__)}"
            )
        if extras is not None and not isinstance(extras, dict):
            raise TypeError(f"extras must be a dict of name -> tensor, got {type(extras).__name__}")
        bad = {
            k: getattr(v, "shape", type(v).__name__)
            for k, v in (extras or {}).items()
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != inputs.shape[0]
        }
        if bad:
            raise ValueError(f"extras must be tensors with the batch's {inputs.shape[0]} rows, got {bad}")

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        loss_fn: Callable[..., torch.Tensor],
        *,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; returns the batch loss (a
        detached scalar, the same on every rank). Gradients are accumulated into ``.grad``.

        Every rank passes the same ``inputs`` (and ``targets``): the first stage embeds them, the
        last computes ``loss_fn(outputs, targets)`` per micro-batch (``loss_fn(outputs)`` when
        ``targets`` is ``None``), and all use their shape to agree on transfer shapes.
        ``extras``: further per-sample tensors (an attention mask, position ids) that every chunk
        of a micro-batch receives (``[Note: per-micro-batch extras]`` in :mod:`colossal.pipeline.stages`).
        """
        self._check_batch(inputs, targets, extras)
        t0, m = time.perf_counter(), self.schedule.m
        warm = self.links.set_signature((tuple(inputs.shape), inputs.dtype, m))
        run = _Run(
            self,
            inputs.to(self.device).chunk(m),
            None if targets is None else targets.to(self.device).chunk(m),
            loss_fn,
            _chunk_extras(extras, m, self.device),
        )
        saved = self._stash_tied_grads()
        if self.p2p_mode == "grouped":
            self._run_grouped(run)
        else:
            self._run_overlapped(run, warm)
        self._reduce_tied_grads(saved)
        loss = self._broadcast_loss(run.losses)
        self.stats = StepStats(
            wall_s=time.perf_counter() - t0, compute_s=run.compute_s, peak_inflight=run.peak, peak_sends=run.peak_sends
        )
        return loss

    def _run_overlapped(self, run: _Run, warm: bool) -> None:
        """Every transfer on its own; receives posted one compute ahead, each send completed as
        soon as the peer is known to have it (``[Note: releasing sends on gloo]``), the rest at the end."""
        posted: dict[Action, object] = {}
        for i, st in enumerate(self._steps):
            for a in st.recvs:  # posted in program order, so messages match on every channel
                if a not in posted:
                    posted[a] = self.links.post_recv(a)
            if warm and i + 1 < len(self._steps):  # start the next step's receive before this compute
                for a in self._steps[i + 1].recvs:
                    if self.links.known(a):
                        posted[a] = self.links.post_recv(a)
            for a in st.recvs:
                run.inbox[(a.kind, a.mb, a.chunk)] = self.links.wait(posted.pop(a))
            self.links.release(self._release[i])  # received by the peer: free before this compute
            run.timed(st.compute)
            for a in st.sends:
                self.links.send(a, run.out)
            run.out = None  # the links hold it until the send is released
            run.peak_sends = max(run.peak_sends, self.links.in_flight)
        self.links.wait_sends()

    def _run_grouped(self, run: _Run) -> None:
        """One ordered ``batch_p2p`` per exchange point: the sends of the block just run with
        the receives of the next (``[Note: p2p order on NCCL]``)."""
        pending: list[tuple[Action, torch.Tensor]] = []
        for block in self._blocks:
            recvs = [a for j in block for a in self._steps[j].recvs]
            for a, t in self.links.exchange(pending, recvs).items():
                run.inbox[(a.kind, a.mb, a.chunk)] = t
            pending = []
            for j in block:
                run.timed(self._steps[j].compute)
                pending += [(a, run.out) for a in self._steps[j].sends]
        if pending:
            self.links.exchange(pending, [])

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            total = torch.stack(losses).float().sum()
            if self.config.loss_reduction == "mean":
                total = total / self.schedule.m
        if self.p > 1:
            cc.broadcast(total, src=self.schedule.rank_of(self.schedule.n_chunks - 1), group=self.group, tag=LOSS_TAG)
        return total

    def _stash_tied_grads(self) -> list[torch.Tensor | None]:
        """What ``.grad`` of each tied copy holds before the step (a copy: engines such as ZeRO
        keep ``.grad`` as a view of their buffers, which the step must update in place)."""
        return [None if self._named[n].grad is None else self._named[n].grad.clone() for n, _ in self._tied]

    @torch.no_grad()
    def _reduce_tied_grads(self, saved: list[torch.Tensor | None]) -> None:
        """Sum each tied weight's gradient of this step over its two copies, in place in ``.grad``
        (which keeps what it held before the step)."""
        for (name, peer), before in zip(self._tied, saved, strict=True):
            p = self._named[name]
            if not p.requires_grad:  # frozen (a LoRA base's tied embedding): no gradient, as in plain PyTorch
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            mine = p.grad if before is None else p.grad - before
            theirs = torch.empty_like(mine)
            ops = [cc.P2POp("send", mine.contiguous(), peer, self.group), cc.P2POp("recv", theirs, peer, self.group)]
            cc.batch_p2p(ops, tag=TIED_TAG)
            total = mine + theirs  # the same bits on both ranks (addition commutes)
            p.grad.copy_(total if before is None else before + total)


class _Run:
    """State of one step: held activations, received tensors, micro-batch losses."""

    def __init__(self, pipe: PipelineParallel, inputs, targets, loss_fn, extras=None) -> None:
        self.pipe, self.inputs, self.targets, self.loss_fn = pipe, inputs, targets, loss_fn
        self.extras: list[dict] | None = extras  # per micro-batch (None: blocks take the hidden state only)
        self.chunks = {c.index: c for c in pipe.chunks}
        self.last = pipe.schedule.n_chunks - 1
        self.scale = 1.0 / pipe.schedule.m if pipe.config.loss_reduction == "mean" else 1.0
        self.inbox: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
        self.held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, chunk) -> (input, output)
        self.losses: list[torch.Tensor] = []
        self.compute_s, self.peak, self.peak_sends = 0.0, 0, 0
        self.out: torch.Tensor | None = None  # what the last compute's sends carry

    def timed(self, a: Action) -> None:
        """Run the compute ``a`` (its output in ``self.out``), adding its time to ``compute_s``."""
        c0 = time.perf_counter()
        self.out = self.compute(a)
        self.compute_s += time.perf_counter() - c0

    def compute(self, a: Action) -> torch.Tensor | None:
        """Run one compute action; return the tensor its sends carry (if any). Labelled in
        profiler traces (the label only built while a profiler records)."""
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(f"colossal.pipeline::{a.kind.value}"):
                return self._compute(a)
        return self._compute(a)

    def _compute(self, a: Action) -> torch.Tensor | None:
        if a.kind == _K.F:
            return self._forward(a.mb, a.chunk)
        if a.kind == _K.BW:
            self.pipe.weight_store.flush((a.mb, a.chunk))
            return None
        if a.kind == _K.BI:
            with self.pipe.weight_store.capture((a.mb, a.chunk)):
                return self._backward(a.mb, a.chunk)
        return self._backward(a.mb, a.chunk)

    def _forward(self, mb: int, c: int) -> torch.Tensor | None:
        if c == 0:
            x = self.inputs[mb]
        else:
            x = self.inbox.pop((_K.RECV_F, mb, c)).detach()
            x.requires_grad_(x.is_floating_point())
        out = self.chunks[c](x) if self.extras is None else self.chunks[c](x, self.extras[mb])
        if c == self.last:
            loss = self.loss_fn(out) if self.targets is None else self.loss_fn(out, self.targets[mb])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', loss)!r}")
            self.losses.append(loss.detach().reshape(()))
            out = loss.reshape(()) * self.scale
        else:
            self.pipe.links.note_output(c, out)
        self.held[(mb, c)] = (x, out)
        self.peak = max(self.peak, len(self.held))
        if c < self.last and self.pipe.schedule.rank_of(c + 1) == self.pipe.rank:
            self.inbox[(_K.RECV_F, mb, c + 1)] = out.detach()
        return out.detach()

    def _backward(self, mb: int, c: int) -> torch.Tensor | None:
        x, out = self.held.pop((mb, c))
        grad = None if c == self.last else self.inbox.pop((_K.RECV_B, mb, c))
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        if c == 0:
            return None
        g = x.grad if x.grad is not None else torch.zeros_like(x)
        if self.pipe.schedule.rank_of(c - 1) == self.pipe.rank:
            self.inbox[(_K.RECV_B, mb, c - 1)] = g
        return g


def _chunk_extras(extras: dict | None, m: int, device: torch.device) -> list[dict] | None:
    """``extras`` cut into ``m`` micro-batches, one fresh dict each (``None`` stays ``None``)."""
    if extras is None:
        return None
    parts = {k: v.to(device).chunk(m) for k, v in extras.items()}
    return [{k: v[i] for k, v in parts.items()} for i in range(m)]


def _partition(
    model: nn.Module, cfg: PipelineConfig, blocks_name: str, n_chunks: int, n_blocks: int
) -> list[tuple[int, int]]:
    """Block ranges of the ``n_chunks`` chunks under ``cfg.partition``."""
    if cfg.partition == "params":
        owners = tensor_owners(model, blocks_name)
        per_block, first, last = [0.0] * n_blocks, 0.0, 0.0
        for name, p in model.named_parameters():
            part, i = owners[name]
            if part == "block":
                per_block[i] += p.numel()
            elif part == "first":
                first += p.numel()
            else:
                last += p.numel()
        return partition_blocks(n_blocks, n_chunks, "params", weights=per_block, first=first, last=last)
    if cfg.partition == "cost":
        weights = [c.time_s if isinstance(c, BlockCost) else float(c) for c in cfg.costs]
        return partition_blocks(n_blocks, n_chunks, "cost", weights=weights)
    return partition_blocks(n_blocks, n_chunks, cfg.partition, sizes=cfg.sizes)


def stage_tensor_names(model: nn.Module, config: PipelineConfig, p: int, rank: int) -> set[str]:
    """Names of the parameters and buffers that the chunks of pipeline rank ``rank`` (of ``p``)
    use: what :class:`PipelineParallel` keeps real there. Pure (no communication), so a caller can
    materialise exactly these tensors before building the pipeline (e.g. before converting them for
    tensor parallelism); raises the same ``ValueError`` as :class:`PipelineParallel` would."""
    schedule = get_schedule(config.schedule, p, config.num_microbatches, config.virtual)
    blocks_name, seq = find_blocks(model, config.blocks)
    bounds = _partition(model, config, blocks_name, schedule.n_chunks, len(seq))
    chunk_ids = [rank + k * p for k in range(schedule.v)]
    chunks = split_model(model, chunk_ids, bounds, blocks=blocks_name, embed=_unused, head=_unused)
    return {n for c in chunks for n in c.param_names}


def _unused(model: nn.Module, x: torch.Tensor) -> torch.Tensor:  # chunks built only for their names
    raise AssertionError("never called")


def _tied_names(model: nn.Module, owners: dict[str, tuple[str, int]]) -> list[tuple[str, str]]:
    """(first-side name, last-side name) of each tensor registered on both sides of the blocks."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    pairs = []
    for names in by_id.values():
        firsts = [n for n in names if owners[n][0] == "first"]
        lasts = [n for n in names if owners[n][0] == "last"]
        if any(owners[n][0] == "block" for n in names) and len(names) > 1:
            raise NotImplementedError(f"parameters shared with a block are not supported: {names}")
        pairs += [(firsts[0], lasts[0])] if firsts and lasts else []
    return pairs


def _unique_params(model: nn.Module, owned: set[str]) -> dict[str, nn.Parameter]:
    named, seen = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in owned and id(p) not in seen:
            seen.add(id(p))
            named[name] = p
    return named
