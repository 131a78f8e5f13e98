"""ZeRO stages 1/2 on the data-parallel axis of the hybrid plugin (``colossal.zero.ZeroOptimizer``
over the ``dp`` group, or ``dp x sp`` for sequence parallelism), in place of DDP.

Each tensor-parallel rank runs its own ZeRO engine over its dp peers, who hold the same tp block.
ZeRO's gathered state (name-keyed, as the ZeroPlugin writes it) is of the tp-local model; the
hybrid plugin then makes it portable over tp exactly as without ZeRO.
"""

from __future__ import annotations

import torch

from colossalai.booster.zero_plugin import ZeroBoostedOptimizer

__all__ = ["HybridZeroOptimizer", "zero_engine", "zero_optimizer_state", "load_zero_optimizer"]


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


def zero_optimizer_state(engine, names: list[str]) -> dict:
    """ZeRO's gathered optimizer state re-keyed from indices to parameter ``names``."""
    if not engine.optimizer.state:
        _init_state(engine.optimizer)
    sd = engine.state_dict()
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def load_zero_optimizer(engine, names: list[str], state: dict) -> None:
    """Inverse of :func:`zero_optimizer_state`."""
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    engine.load_state_dict({"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups})


@torch.no_grad()
def _init_state(inner: torch.optim.Optimizer) -> None:
    """A zero-gradient, zero-lr step: a never-stepped optimizer gets the state DCP reads into."""
    lrs = [g["lr"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    inner.step()
    for g, lr in zip(inner.param_groups, lrs, strict=True):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None
