"""Colossal meta-package: Booster and plugins, CLI, checkpoints, models.

```python
from colossalai import Booster, TorchDDPPlugin, TorchFSDPPlugin
from colossalai.models import build_gpt
```
"""

from colossalai.booster import (
    BoostedModel,
    BoostedOptimizer,
    Booster,
    GeminiPlugin,
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
    "Precision",
    "BoostedModel",
    "BoostedOptimizer",
]
