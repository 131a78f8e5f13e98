"""1D/2D/2.5D/3D tensor parallelism and sequence parallelism.

One module per mode (:mod:`~colossal.tensor_parallel.one_d`, ``two_d``, ``two_p5_d``,
``three_d``, ``sequence``), each with parallel layers convertible from dense ones
(``from_dense``) and an ``apply_*`` entry converting a whole model in place from a plan
(:mod:`~colossal.tensor_parallel.plan`); :func:`parallelize` dispatches on the mode name.
"""

from colossal.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from colossal.tensor_parallel.one_d import (
    Embedding1D,
    LayerNorm1D,
    Linear1D,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    apply_1d,
    cross_entropy_1d,
    gather_output_1d,
    split_input_1d,
)
from colossal.tensor_parallel.plan import Style, convert_model, gpt_plan, replace_module, resolve_plan
from colossal.tensor_parallel.rng import DropoutMode, ParallelDropout, RNGTracker
from colossal.tensor_parallel.sequence import (
    SequenceParallelAttention,
    SequencePositionEmbedding,
    all_reduce_gradients,
    all_to_all_attention,
    apply_sequence,
    gather_sequence,
    ring_attention,
    split_sequence,
)
from colossal.tensor_parallel.two_d import (
    Embedding2D,
    Grid2D,
    LayerNorm2D,
    Linear2D,
    VocabParallelEmbedding2D,
    VocabParallelLMHead2D,
    apply_2d,
    cross_entropy_2d,
    gather_output_2d,
    split_input_2d,
)
from colossal.tensor_parallel.two_p5_d import (
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabParallelEmbedding2p5D,
    VocabParallelLMHead2p5D,
    apply_2p5d,
    cross_entropy_2p5d,
    gather_output_2p5d,
    grid_2p5d,
    split_input_2p5d,
)
from colossal.tensor_parallel.validation import check_divisible, grid_side

__all__ = [
    "apply_2p5d",
    "cross_entropy_2p5d",
    "gather_output_2p5d",
    "split_input_2p5d",
    "grid_2p5d",
    "VocabParallelLMHead2p5D",
    "VocabParallelEmbedding2p5D",
    "Embedding2p5D",
    "LayerNorm2p5D",
    "Linear2p5D",
    "apply_2d",
    "cross_entropy_2d",
    "gather_output_2d",
    "split_input_2d",
    "VocabParallelLMHead2D",
    "VocabParallelEmbedding2D",
    "Embedding2D",
    "LayerNorm2D",
    "Linear2D",
    "Grid2D",
    "split_sequence",
    "ring_attention",
    "gather_sequence",
    "apply_sequence",
    "all_to_all_attention",
    "all_reduce_gradients",
    "SequencePositionEmbedding",
    "SequenceParallelAttention",
    "DropoutMode",
    "Embedding1D",
    "LayerNorm1D",
    "Linear1D",
    "ParallelDropout",
    "RNGTracker",
    "Style",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "apply_1d",
    "check_divisible",
    "convert_model",
    "cross_entropy_1d",
    "gather_output_1d",
    "gpt_plan",
    "grid_side",
    "replace_module",
    "resolve_plan",
    "split_input_1d",
    "vocab_parallel_cross_entropy",
]
