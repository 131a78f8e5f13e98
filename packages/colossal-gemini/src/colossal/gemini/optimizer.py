"""GeminiOptimizer: steps any element-wise torch optimizer on the fp32 master shards of the chunks.

The wrapped optimizer's parameters are replaced by fp32 views of the master shards (one per
parameter slice this rank holds); their ``.grad`` are views of the fp32 gradient shards. Loss
scaling, the global gradient-norm clip and the overflow skip come from ``colossal.optim``.

[Note: element-wise and layer-wise optimizers]
A parameter may be split across chunk shards (and ranks), so the optimizer sees 1-D slices.
Element-wise rules (SGD, Adam/AdamW, HybridAdam, CPUAdam) give the same update on slices as on
the whole tensor. Layer-wise rules (LAMB, LARS: an optimizer with a ``norm_reducer`` attribute,
``colossal.optim``'s contract) need whole-parameter norms: they get one slice per parameter on
every rank, an empty one where the rank holds none of it (so every rank's norm vector has the
same length and order; it gets an empty gradient, so the rule keeps that parameter's scalar
states, e.g. LARS's ``scale``, on every rank, which checkpoints save per parameter), and, when
chunks are sharded, a ``norm_reducer`` that sums the per-parameter squared norms over the
data-parallel group. Rules that need a parameter's shape
(Adafactor) are refused at setup (``[Note: optimizers a sharded engine can run]`` in
``colossal.optim.shardable``).

[Note: parameters without a gradient]
``torch.optim`` leaves a parameter whose ``.grad`` is None untouched (no weight decay, no momentum,
no step count). Each step agrees over the data-parallel group which parameters got a gradient on
any rank since the last step (one all-reduce of a byte per parameter; as with DDP, one rank's
gradient is every rank's); the others' slices get no ``.grad``, so the wrapped optimizer skips them
on every rank alike (LAMB/LARS norm vectors still line up).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import colossal.comm as comm
from colossal.gemini import events
from colossal.gemini.chunk import Chunk
from colossal.gemini.ddp import GeminiDDP
from colossal.gemini.tiers import transfer
from colossal.optim import (
    ConstantLossScaler,
    DynamicLossScaler,
    OptimizerWrapper,
    check_shardable,
    clip_grad_norm_,
    grad_norm,
    group_norm_reducer,
    has_inf_or_nan,
)

__all__ = ["GeminiOptimizer"]


class GeminiOptimizer(OptimizerWrapper):
    """Wraps ``optim`` (built over ``model.parameters()``) to step on Gemini's fp32 master shards.

    Use ``optim.backward(loss)`` instead of ``loss.backward()``; several backward calls before one
    ``step()`` accumulate gradients.

    Conventions shared with ``colossal.zero.ZeroOptimizer``: ``max_grad_norm=None`` disables clipping
    (a value must be positive: ``torch.nn.utils.clip_grad_norm_(max_norm=0)`` would zero every
    gradient); a step whose gradients hold an inf or NaN is skipped on every rank in every precision
    (``check_overflow=False`` turns that off for fp32/bf16), counted in ``skipped_steps``;
    ``last_grad_norm`` holds the pre-clip norm of the last clipped step; :meth:`grad_norm` reads the
    norm before stepping.

    A ``torch.optim.Optimizer`` (``[Note: wrappers are optimizers]`` in ``colossal.optim.wrapper``):
    torch's LR schedulers and step hooks work on it directly; ``param_groups`` are the wrapped
    optimizer's (their ``params`` are the fp32 master slices); ``state_dict()`` is the full state in
    ``torch.optim``'s form (indices over the original param groups), loadable by the plain optimizer.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        model: GeminiDDP,
        *,
        loss_scaler=None,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        check_overflow: bool = True,
    ):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        check_shardable(optim, "GeminiOptimizer")
        if not isinstance(model, GeminiDDP):
            raise TypeError(f"model must be a GeminiDDP, got {type(model).__name__}")
        if optim.state:
            raise ValueError("optim must not have stepped yet (its state is not empty)")
        if getattr(optim, "flatten", False):
            raise ValueError(
                f"{type(optim).__name__}(flatten=True) would move the parameters into its own flat buffers; "
                f"Gemini already keeps them in flat fp32 chunks: construct it with flatten=False"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None (None disables clipping), got {max_grad_norm}")
        self._wrap(optim)
        self.optim, self.model = optim, model
        self.manager = model.manager
        if loss_scaler is None:
            loss_scaler = DynamicLossScaler() if model.dtype == torch.float16 else ConstantLossScaler()
        self.scaler = loss_scaler
        self.max_grad_norm, self.norm_type = max_grad_norm, norm_type
        self.check_overflow = check_overflow  # also skip non-finite steps with a constant loss scale
        self.last_grad_norm: torch.Tensor | None = None
        """Global gradient norm (before clipping) of the last step that clipped (``max_grad_norm`` set)."""
        self.slices: dict[int, list[tuple[nn.Parameter, int, int, str]]] = {}  # chunk -> (fake, lo, hi, name)
        self.empty: list[tuple[nn.Parameter, str]] = []  # layer-wise: (empty fake, name) of parameters held elsewhere
        self._replace_params()
        self.manager.repoint = self._repoint  # see [Note: aliased masters] in colossal.gemini.chunk_manager
        self.skipped_steps = 0

    def _replace_params(self) -> None:
        m = self.manager
        layerwise = hasattr(self.optim, "norm_reducer")  # see [Note: element-wise and layer-wise optimizers]
        if layerwise:
            self._install_norm_reducer()
        self._whole: list[tuple[nn.Parameter, nn.Parameter]] = []  # (slice, parameter): used unsharded only
        self._group_names: list[list[str]] = []  # per param group, its parameters' names (torch's indices)
        for group in self.optim.param_groups:
            fakes = []
            if any(p not in m.chunk_of for p in group["params"]):
                raise ValueError("optim holds a parameter that is not a parameter of the GeminiDDP model")
            self._group_names.append([m.chunk_of[p][1].name for p in group["params"]])
            for p in group["params"]:
                chunk, info = m.chunk_of[p]
                if chunk.frozen:  # no gradient ever: no slice, no state ([Note: frozen chunks] in chunk.py)
                    continue
                s_lo, s_hi = chunk.shard_range(m.rank)
                lo, hi = max(info.offset, s_lo) - s_lo, min(info.offset + info.numel, s_hi) - s_lo
                if lo >= hi:  # no element of this parameter on this rank
                    if layerwise:
                        fakes.append(nn.Parameter(chunk.master[:0]))
                        self.empty.append((fakes[-1], info.name))
                    continue
                if "master" in chunk.on_disk:  # a placeholder until the step streams the block in
                    fake = nn.Parameter(torch.empty(0).new_empty(hi - lo).resize_(hi - lo))
                    fake.data.untyped_storage().resize_(0)
                else:
                    fake = nn.Parameter(chunk.master[lo:hi])
                self.slices.setdefault(chunk.id, []).append((fake, lo, hi, info.name))
                self._whole.append((fake, info.param))
                fakes.append(fake)
            group["params"] = fakes

    def _install_norm_reducer(self) -> None:
        if self.optim.norm_reducer is not None:
            raise ValueError(
                f"{type(self.optim).__name__}.norm_reducer is already set; build it with norm_reducer=None: "
                "GeminiOptimizer reduces the per-parameter norms over the data-parallel group itself"
            )
        if self.manager.sharded:  # whole chunks on every rank need no reduction
            self.optim.norm_reducer = group_norm_reducer(self.manager.group, all_reduce=_reduce("norms"))

    def _repoint(self, chunk: Chunk) -> None:
        """Point the optimizer's slice views of ``chunk`` at its current master."""
        for fake, lo, hi, _ in self.slices.get(chunk.id, ()):
            fake.data = chunk.master[lo:hi]

    # -- training API -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with loss scaling."""
        try:
            self.scaler.scale_loss(loss).backward()
        except BaseException:
            self.model._stop_tracking()  # outside the engine now: see GeminiDDP._stop_tracking
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the next reduction overwrites the gradient shards)."""
        self.model.pop_inert_tracker()  # a bare loss.backward() that failed in warm-up: see GeminiDDP._stop_tracking
        if self.model.native_grads() is not None:  # see [Note: native gradients] in colossal.gemini.ddp
            for p in self.manager.chunk_of:
                p.grad = None
        for c in self.manager.chunks:
            c.has_grad = False
            c.got_grad.clear()

    def _grads(self) -> list[torch.Tensor]:
        native = self.model.native_grads()
        if native is not None:  # the gradients autograd left in param.grad ([Note: native gradients])
            return [p.grad for p, _ in native if p.grad is not None]
        if self.manager.disk is not None:  # the shards in memory only: [Note: gradients with a disk tier]
            from colossal.gemini.disk import memory_grads

            return memory_grads(self.manager)
        for c in self.manager.trainable:
            if not c.has_grad:  # no backward since the last step: stale contents mean zero
                c.grad_shard.zero_()
                c.has_grad = True
        return [c.grad_shard for c in self.manager.trainable]

    def step(self, closure=None) -> bool:
        """Unscale, skip on overflow, clip, step, refresh the working weights; returns False when skipped."""
        if closure is not None:
            raise NotImplementedError("GeminiOptimizer.step supports closure=None only")
        self.model.pop_inert_tracker()
        if self.manager.disk is not None:  # blocks on disk stream through the step (colossal.gemini.disk)
            from colossal.gemini.disk import optimizer_step

            return optimizer_step(self)
        with events.label("step"):
            grads = self._grads()
            if self.scaler.scale != 1.0:
                self.scaler.unscale_(grads)
            # fp16's dynamic scale can overflow; fp32/bf16 with a constant scaler are checked only on request
            check = self.check_overflow or isinstance(self.scaler, DynamicLossScaler)
            found_inf = check and self._overflow(grads)
            if found_inf:
                self.skipped_steps += 1
            else:
                without = self._params_without_grad()
                if self.max_grad_norm is not None:
                    self._clip(grads)
                self._inner_step(without)
            self.scaler.update(found_inf)
            self.zero_grad()
            self.model.end_iteration(None if found_inf else self)
            return not found_inf

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        """Whether any rank's gradients hold an inf or NaN. On one rank with gradients in ``param.grad``
        (``[Note: native gradients]``) finite L1 norms prove it first: one foreach operator for all the
        tensors (a sum per tensor was one operator each: host time on a GPU), accumulated in fp32 so
        fp16 gradients do not overflow it, empty tensors included. ``has_inf_or_nan`` (grouping, a
        flag and a reduction that cost as much again on small models) decides only when a norm is
        not finite."""
        if self.model.native_grads() is not None and grads:
            if bool(torch.stack(torch._foreach_norm(grads, 1, dtype=torch.float32)).isfinite().all()):
                return False
        return has_inf_or_nan(grads, group=self.manager.group, all_reduce=_reduce("overflow"))

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of the gradients the next ``step()`` applies (unscaled), over every rank's chunk
        shards: what ``torch.nn.utils.clip_grad_norm_`` returns. Collective; call between backward and
        ``step()``."""
        m, grads = self.manager, self._grads()
        if m.disk is not None:  # and the blocks on disk as per-chunk norms, as the step composes them
            from colossal.gemini.disk import disk_grads_stats

            grads = grads + disk_grads_stats(self, m.chunks, norm_type, True)[1]
        kw = dict(group=m.group, all_reduce=_reduce("grad_norm"))
        if m.replicated:  # every rank holds the same whole gradients: count them once
            total = grad_norm([], norm_type, replicated=grads, **kw)
        else:
            total = grad_norm(grads, norm_type, **kw)
        return total / self.scaler.scale

    def _clip(self, grads: list[torch.Tensor]) -> None:
        m = self.manager
        kw = dict(group=m.group, all_reduce=_reduce("grad_norm"))
        if m.replicated:  # every rank holds the same whole gradients: count them once
            norm = clip_grad_norm_([], self.max_grad_norm, self.norm_type, replicated=grads, **kw)
        else:
            norm = clip_grad_norm_(grads, self.max_grad_norm, self.norm_type, **kw)
        self.last_grad_norm = norm

    def _params_without_grad(self) -> set[str]:
        """Names of the parameters no rank gave a gradient since the last step (collective when
        data-parallel; see [Note: parameters without a gradient])."""
        m = self.manager
        native = self.model.native_grads()
        if native is not None:  # one rank: param.grad says it
            return {name for p, name in native if p.grad is None}
        infos = [(c, info) for c in m.trainable for info in c.tensors]
        got = [info.offset in c.got_grad for c, info in infos]
        if m.dp_size > 1:
            flags = torch.tensor(got, dtype=torch.uint8, device=m.device.device)
            comm.all_reduce(flags, "max", m.group, tag="gemini.grad_presence")
            got = flags.bool().tolist()
        return {info.name for (_, info), g in zip(infos, got, strict=True) if not g}

    def _inner_step(self, without: set[str] = frozenset()) -> None:
        if self.model.native_grads() is not None:  # see [Note: native gradients] in colossal.gemini.ddp
            self._native_step()
            return
        for chunk in self.manager.chunks:
            for fake, lo, hi, name in self.slices.get(chunk.id, ()):
                fake.grad = None if name in without else chunk.grad_shard[lo:hi]
        for fake, name in self.empty:  # an empty gradient: the rule keeps this parameter's scalar states too
            fake.grad = None if name in without else fake.data.new_zeros(0)
        self.optim.step()
        for fake, _ in self.empty:
            fake.grad = None
        for chunk in self.manager.chunks:
            for fake, *_ in self.slices.get(chunk.id, ()):
                fake.grad = None
            self.manager.refresh_working(chunk)

    def _native_step(self) -> None:
        """Step on the gradients in ``param.grad``: whole parameters, one slice each (the chunks are not
        sharded), so each slice's gradient is its parameter's, flattened (a view, no copy); a parameter
        whose ``.grad`` is None gets none and is skipped by the wrapped optimizer. The masters are the
        working chunks: nothing to refresh."""
        pairs = self._whole
        for fake, p in pairs:
            g = p.grad
            fake.grad = None if g is None else g.view(-1)
        self.optim.step()
        for fake, _ in pairs:
            fake.grad = None

    # -- state in torch's form ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full optimizer state as ``torch.optim`` writes it: ``state`` keyed by index over the
        original param groups (a parameter that never had a gradient has no entry), ``param_groups``
        with their hyperparameters and ``params`` indices, plus ``"loss_scaler"``. Loadable by the
        plain optimizer built over the plain model. Collective (gathers): call on every rank."""
        from colossal.gemini.checkpoint import optimizer_state_dict

        sd = optimizer_state_dict(self)
        index, groups, start = {}, [], 0
        for g, names in zip(sd["param_groups"], self._group_names, strict=True):
            index.update({n: start + i for i, n in enumerate(names)})
            groups.append({**g, "params": list(range(start, start + len(names)))})
            start += len(names)
        state = {index[n]: v for n, v in sd["state"].items()}
        return {"state": dict(sorted(state.items())), "param_groups": groups, "loss_scaler": sd["loss_scaler"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state as :meth:`state_dict` or a plain ``torch.optim`` optimizer over the plain model
        writes it (every rank passes the full dict; each keeps its own slices). Strict, as torch: the
        group count and sizes must match; every problem is listed before anything changes."""
        from colossal.gemini.checkpoint import load_optimizer_state_dict

        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self._group_names):
            raise ValueError(
                f"loaded state dict has {len(groups)} param groups, this optimizer has {len(self._group_names)}"
            )
        sizes = [(len(g["params"]), len(names)) for g, names in zip(groups, self._group_names, strict=True)]
        if any(a != b for a, b in sizes):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
                f"loaded sizes {[a for a, _ in sizes]}, this optimizer's {[b for _, b in sizes]}"
            )
        name_of = {i: n for g, names in zip(groups, self._group_names, strict=True) for i, n in zip(g["params"], names)}
        unknown = sorted(k for k in state_dict.get("state", {}) if k not in name_of)
        if unknown:
            raise ValueError(f"loaded state dict has state for unknown parameter indices {unknown}")
        sd = {
            "state": {name_of[i]: v for i, v in state_dict.get("state", {}).items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
        }
        if "loss_scaler" in state_dict:
            sd["loss_scaler"] = state_dict["loss_scaler"]
        load_optimizer_state_dict(self, sd)

    def save_sharded(self, path: str) -> None:
        """Save the model and this optimizer's shards (:func:`colossal.gemini.save_sharded`), as
        ``ZeroOptimizer.save_sharded(path)`` does for ZeRO. Collective: every rank calls it."""
        from colossal.gemini.checkpoint import save_sharded

        save_sharded(path, self.model, self)

    def load_sharded(self, path: str, *, strict: bool = True):
        """Load a :meth:`save_sharded` checkpoint of any world size (:func:`colossal.gemini.load_sharded`:
        strict, every mismatch listed; ``strict=False`` returns what it skipped). Collective."""
        from colossal.gemini.checkpoint import load_sharded

        return load_sharded(path, self.model, self, strict=strict)

    # -- optimizer blocks (used by the placement at the end of warm-up) -----------------------------------
    def block_bytes(self, chunk: Chunk) -> int:
        """Bytes of the chunk's optimizer block: fp32 master + fp32 gradient + optimizer states (none for
        a frozen chunk)."""
        if chunk.frozen:
            return 0
        states = sum(
            t.numel() * t.element_size()
            for fake, *_ in self.slices.get(chunk.id, ())
            for t in self.optim.state.get(fake, {}).values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return chunk.master.numel() * 4 * 2 + states

    def move_block(self, chunk: Chunk, dst: str) -> None:
        """Move the chunk's optimizer block to tier ``dst`` (counted), re-pointing the optimizer's views."""
        m = self.manager
        if chunk.frozen:  # no block
            return
        if chunk.on_disk:  # the block stays where the disk plan put it (its disk parts are charged there)
            if not chunk.states_accounted and "states" not in chunk.on_disk:
                m.host.charge(self.block_bytes(chunk) - chunk.master.numel() * 8)
            chunk.states_accounted = True
            return
        if not chunk.states_accounted:  # created by the first step on the host tier: account them there
            m.host.charge(self.block_bytes(chunk) - chunk.master.numel() * 8)
            chunk.states_accounted = True
        if chunk.o_tier == dst:
            return
        src_tier, dst_tier = m.tier(chunk.o_tier), m.tier(dst)
        m.move_optim(chunk, dst)
        for fake, lo, hi, _ in self.slices.get(chunk.id, ()):
            fake.data = chunk.master[lo:hi]  # (a master aliased with the payload was copied: it is its own now)
            state = self.optim.state.get(fake, {})
            for k, t in list(state.items()):
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    state[k] = transfer(t, src_tier, dst_tier, m.traffic, chunk.id, "placement")


def _reduce(what: str):
    """``colossal.comm.all_reduce`` tagged ``gemini.<what>``: the reductions inside ``colossal.optim``
    become comm events like the rest of Gemini's traffic."""
    return functools.partial(comm.all_reduce, tag=f"gemini.{what}")
