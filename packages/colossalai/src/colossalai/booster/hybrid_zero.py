"""ZeRO stages 1/2 on the data-parallel axis of the hybrid plugin (``colossal.zero.ZeroOptimizer``
over the ``dp`` group, or ``dp x sp`` for sequence parallelism), in place of DDP.

Each tensor-parallel rank runs its own ZeRO engine over its dp peers, who hold the same tp block.
ZeRO's gathered state (name-keyed, as the ZeroPlugin writes it) is of the tp-local model; the
hybrid plugin then makes it portable over tp exactly as without ZeRO.
"""

from __future__ import annotations

import torch

from colossalai.booster.zero_plugin import ZeroBoostedOptimizer

__all__ = ["HybridZeroOptimizer", "zero_engine"]


class HybridZeroOptimizer(ZeroBoostedOptimizer):
    """The ZeroPlugin's optimizer view; clipping is refused under tensor parallelism, where ZeRO's
    norm (over its dp shards only) would miss the tp shards."""

    def __init__(self, zero, tp_size: int) -> None:
        super().__init__(zero)
        self.tp_size = tp_size

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip inside the next ``step()`` (sequence / data parallel only); returns None."""
        if self.tp_size > 1:
            raise NotImplementedError(
                "HybridParallelPlugin clips with zero_stage > 0 only when tp_size=1 (sequence/data parallel); "
                f"got tp_size={self.tp_size} (use zero_stage=0 to clip under tensor parallelism)"
            )
        super().clip_grad_norm(max_norm, norm_type)


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
