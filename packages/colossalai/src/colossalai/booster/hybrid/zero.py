"""ZeRO stages 1/2 on the data-parallel axis of the hybrid plugin (``colossal.zero.ZeroOptimizer``
over the ``dp`` group, or ``dp x sp`` for sequence parallelism), in place of DDP.

Each tensor-parallel rank runs its own ZeRO engine over its dp peers, who hold the same tp block.
ZeRO's gathered state (name-keyed, as the ZeroPlugin writes it) is of the tp-local model; the
hybrid plugin then makes it portable over tp exactly as without ZeRO.

[Note: clipping tensor-parallel ZeRO shards]
ZeRO clips over its own group only, which under tensor parallelism misses the other tp blocks and
counts a tp-replicated parameter (1D LayerNorms, 2.5D depth copies) once per tp rank. So under
tp the plugin leaves ZeRO's ``max_grad_norm`` unset and clips in a step pre-hook of the inner
torch optimizer: ZeRO calls that optimizer's ``step()`` with the reduced, unscaled, averaged shard
gradients on its fp32 masters. Each master element belongs to one parameter
(``FlatParam.slices()``); an element of a parameter that ``m`` tp ranks hold is weighted by
``m^(-1/p)``, and ``colossal.optim.grad_norm`` sums over the whole ``dp (x sp) x tp`` world, where
every (dp-sharded, tp-blocked) element then counts once: the norm of the dense gradients.
"""

from __future__ import annotations

import functools
import math

import torch

from colossalai.booster.zero_plugin import ZeroBoostedOptimizer

__all__ = ["HybridZeroOptimizer", "zero_engine"]


class HybridZeroOptimizer(ZeroBoostedOptimizer):
    """The ZeroPlugin's optimizer view. Without tensor parallelism ZeRO clips itself; with it
    (``replicas``: parameter id -> how many tp ranks hold each of its elements) the clip is done
    by this class, over ``group`` (every rank), see ``[Note: clipping tensor-parallel ZeRO shards]``."""

    def __init__(self, zero, replicas: dict[int, int] | None = None, group=None) -> None:
        super().__init__(zero)
        self.replicas, self.norm_group = replicas, group
        self._pending: tuple[float, float] | None = None  # (max_norm, norm_type) for the next step
        if replicas is not None:
            self._hook = zero.optimizer.register_step_pre_hook(self._clip_before_step)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip inside the next ``step()`` by the dense gradient norm; returns that norm before
        clipping (unscaled, each element counted once), as ``torch.nn.utils.clip_grad_norm_``.
        Collective."""
        if self.replicas is None:
            return super().clip_grad_norm(max_norm, norm_type)
        self._pending = (float(max_norm), float(norm_type))
        engine = self.engine
        engine.grad_norm(norm_type)  # waits for the reductions and fills the masters' summed gradients
        total = self._dense_norm(float(norm_type))
        return total / (engine.world * engine.replicas * engine.scaler.scale)

    def _dense_norm(self, p: float) -> torch.Tensor:
        """The norm of the masters' gradients as they are now, each dense element counted once,
        over ``norm_group``."""
        from colossal.comm import all_reduce
        from colossal.optim import grad_norm

        reduce = functools.partial(all_reduce, tag="hybrid.zero.grad_norm")
        return grad_norm(self._weighted_grads(p), p, group=self.norm_group, all_reduce=reduce)

    def _weighted_grads(self, p: float) -> list[torch.Tensor]:
        out = []
        for flat in self.engine.flats:
            grad = None if flat.master is None else flat.master.grad
            if grad is None:
                continue
            weights = torch.ones_like(grad)  # the padding's gradient is zero
            for s in flat.slices():
                m = self.replicas[id(flat.params[s.index])]
                if m > 1 and p != math.inf:  # a max is not changed by duplicates
                    weights[s.shard_start : s.shard_start + s.numel] = m ** (-1.0 / p)
            out.append(grad * weights)
        return out

    def _clip_before_step(self, optimizer, args, kwargs) -> None:
        """ZeRO's masters hold their final gradients: clip them by the dense norm."""
        if self._pending is None:
            return
        (max_norm, p), self._pending = self._pending, None
        with torch.profiler.record_function("colossalai.booster::hybrid_zero_clip"):
            total = self._dense_norm(p)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for flat in self.engine.flats:
                if flat.master is not None and flat.master.grad is not None:
                    flat.master.grad.mul_(coef.to(flat.master.grad.device))
        self.engine.last_grad_norm = total


def zero_engine(model, optimizer, stage: int, group):
    """A fp32 ``ZeroOptimizer`` of ``stage`` over ``group`` (autocast stays the Booster's), and the
    parameter name of each optimizer index (ZeRO's state dicts are index-keyed)."""
    from colossal.zero import ZeroOptimizer

    if optimizer is None:
        raise ValueError("HybridParallelPlugin with zero_stage > 0 needs an optimizer (boost(model, optimizer, ...))")
    by_id = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    names = [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]
    with torch.profiler.record_function("colossalai.booster::hybrid_zero_wrap"):
        return ZeroOptimizer(optimizer, model, stage=stage, group=group, param_dtype=torch.float32), names
