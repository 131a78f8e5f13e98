"""Colossal meta-package: Booster and plugins, CLI, checkpoints, models.

```python
from colossalai import Booster, ZeroPlugin
from colossalai.models import build_gpt
```
"""

from colossalai.booster import (
    BoostedModel,
    BoostedOptimizer,
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    Plugin,
    Precision,
    RunState,
    TorchDDPPlugin,
    TorchFSDPPlugin,
    ZeroPlugin,
)

__all__ = [
    "Booster",
    "RunState",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "ZeroPlugin",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "Precision",
    "BoostedModel",
    "BoostedOptimizer",
]
