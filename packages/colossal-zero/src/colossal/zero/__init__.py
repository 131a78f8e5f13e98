"""colossal.zero: ZeRO stages 1-3 (Rajbhandari et al., 2020) with static CPU offload (ZeRO-Offload,
Ren et al., 2021), mixed precision and reshardable checkpoints, over ``colossal.comm``.

::

    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=3)
    for x, y in data:
        loss = loss_fn(model(x), y)
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
"""

from colossal.zero._events import ChunkMoveEvent, MemorySample, ObserverHandle, register_observer
from colossal.zero._flat_param import FlatParam, ShardedState
from colossal.zero.checkpoint import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    load_sharded,
    load_sharded_state_dict,
    save_sharded,
    sharded_state_dict,
)
from colossal.zero.config import ShardStrategy, ZeroConfig
from colossal.zero.optimizer import ZeroOptimizer

__all__ = [
    "ChunkMoveEvent",
    "FlatParam",
    "MemorySample",
    "ObserverHandle",
    "ShardStrategy",
    "ShardedState",
    "ZeroConfig",
    "ZeroOptimizer",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "load_sharded",
    "load_sharded_state_dict",
    "register_observer",
    "save_sharded",
    "shard_model",
    "sharded_state_dict",
]


def shard_model(model, optimizer, **kwargs) -> ZeroOptimizer:
    """Stage 3 in one call: shard ``model`` in place for ``optimizer`` (built over its parameters)
    and return the :class:`ZeroOptimizer` that steps it; ``kwargs`` are :class:`ZeroConfig` fields."""
    if "stage" in kwargs and kwargs["stage"] != 3:
        raise ValueError(f"shard_model is stage 3; got stage={kwargs['stage']} (use ZeroOptimizer for 1/2)")
    return ZeroOptimizer(optimizer, model, **{**kwargs, "stage": 3})
