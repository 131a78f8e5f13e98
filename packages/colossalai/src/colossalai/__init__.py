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

__distribution__ = "colossal-stack"
"""This project's marker: ``colossalai check`` warns when the imported ``colossalai`` lacks it (the
public index's ``colossalai`` is another project)."""

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
