"""Colossal meta-package: Booster and plugins, CLI, checkpoints, models.

```python
from colossalai import Booster, TorchDDPPlugin
from colossalai.models import build_gpt
```
"""

from colossalai.booster import BoostedModel, BoostedOptimizer, Booster, Plugin, Precision, RunState, TorchDDPPlugin

__all__ = ["Booster", "RunState", "Plugin", "TorchDDPPlugin", "Precision", "BoostedModel", "BoostedOptimizer"]
