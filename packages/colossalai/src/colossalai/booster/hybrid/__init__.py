"""The hybrid-parallel plugin: data x pipeline x tensor x sequence parallelism, one module per
axis applied in one order by the plugin (see :mod:`colossalai.booster.hybrid.plugin`)."""

from colossalai.booster.hybrid.plugin import HybridParallelPlugin
from colossalai.booster.hybrid.shards import ShardIndex, TensorParallelOptimizer, multiplicity
from colossalai.booster.hybrid.zero import HybridZeroOptimizer

__all__ = ["HybridParallelPlugin", "HybridZeroOptimizer", "ShardIndex", "TensorParallelOptimizer", "multiplicity"]
