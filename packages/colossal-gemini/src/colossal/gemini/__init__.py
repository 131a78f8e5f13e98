"""colossal.gemini: chunk-based heterogeneous memory management for training models larger than the device.

Wrap the model (:class:`GeminiDDP`) and the optimizer (:class:`GeminiOptimizer`) and keep your own loop::

    model = GeminiDDP(model, placement="auto", device_memory_budget=64 << 20, mixed_precision=torch.bfloat16)
    optim = GeminiOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, max_grad_norm=1.0)
    loss = loss_fn(model(x), y); optim.backward(loss); optim.step()
"""

from colossal.gemini.checkpoint import (
    load_model_state_dict,
    load_optimizer_state_dict,
    load_sharded,
    load_sharded_state_dict,
    model_state_dict,
    optimizer_state_dict,
    save_sharded,
    sharded_entries,
    sharded_state_dict,
)
from colossal.gemini.chunk import Chunk, ChunkState, IllegalTransitionError, TensorInfo, TensorState
from colossal.gemini.chunk_manager import ChunkManager, pack, search_chunk_size
from colossal.gemini.config import GeminiConfig
from colossal.gemini.ddp import GeminiDDP
from colossal.gemini.disk import DiskTier
from colossal.gemini.events import ChunkMoveEvent, MemorySample, ObserverHandle, register_observer
from colossal.gemini.optimizer import GeminiOptimizer
from colossal.gemini.placement import (
    AutoPolicy,
    BeladyResult,
    PlacementPolicy,
    StaticPolicy,
    TwoLevelResult,
    WarmupPolicy,
    belady,
    belady_two_level,
)
from colossal.gemini.stats import GeminiStats
from colossal.gemini.tiers import CPU_DEFAULT_BUDGET, BudgetExceededError, DeviceTier, HostTier, Tier, Traffic
from colossal.gemini.tracer import NonModelTracker, OpRecord, Trace

__all__ = [
    "CPU_DEFAULT_BUDGET",
    "AutoPolicy",
    "BeladyResult",
    "BudgetExceededError",
    "Chunk",
    "ChunkManager",
    "ChunkMoveEvent",
    "ChunkState",
    "DeviceTier",
    "DiskTier",
    "GeminiConfig",
    "GeminiDDP",
    "GeminiOptimizer",
    "GeminiStats",
    "HostTier",
    "IllegalTransitionError",
    "MemorySample",
    "NonModelTracker",
    "ObserverHandle",
    "OpRecord",
    "PlacementPolicy",
    "StaticPolicy",
    "TensorInfo",
    "TensorState",
    "Tier",
    "Trace",
    "Traffic",
    "TwoLevelResult",
    "WarmupPolicy",
    "belady",
    "belady_two_level",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "load_sharded",
    "load_sharded_state_dict",
    "model_state_dict",
    "optimizer_state_dict",
    "pack",
    "register_observer",
    "save_sharded",
    "search_chunk_size",
    "sharded_state_dict",
    "sharded_entries",
]
