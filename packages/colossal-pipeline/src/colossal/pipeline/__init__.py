"""colossal.pipeline: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1).

Split a model's block sequence into stages (optionally several virtual chunks per rank), run
a schedule's actions with activations and gradients moving through ``colossal.comm``, and get the
batch loss on every rank with gradients equal to single-process training.
"""

from colossal.pipeline.forward_split import ForwardSplit, split_forward
from colossal.pipeline.p2p import HEADER_TAG, P2P_TAG, StageLinks
from colossal.pipeline.runtime import (
    LOSS_TAG,
    TIED_TAG,
    PipelineConfig,
    PipelineParallel,
    StepStats,
    stage_tensor_names,
)
from colossal.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    get_schedule,
)
from colossal.pipeline.simulate import ScheduleError, SimResult, simulate
from colossal.pipeline.stages import (
    BLOCK_CANDIDATES,
    BlockCost,
    StageChunk,
    check_initialised,
    find_blocks,
    materialize_owned,
    measure_block_costs,
    partition_blocks,
    split_model,
)
from colossal.pipeline.weight_grad import WeightGradStore

__all__ = [
    "BLOCK_CANDIDATES",
    "HEADER_TAG",
    "LOSS_TAG",
    "P2P_TAG",
    "SCHEDULES",
    "TIED_TAG",
    "Action",
    "ActionKind",
    "BlockCost",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "PipelineConfig",
    "PipelineParallel",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageChunk",
    "ForwardSplit",
    "check_initialised",
    "split_forward",
    "StageLinks",
    "StepStats",
    "WeightGradStore",
    "ZeroBubbleH1",
    "find_blocks",
    "get_schedule",
    "materialize_owned",
    "measure_block_costs",
    "partition_blocks",
    "simulate",
    "split_model",
    "stage_tensor_names",
]
