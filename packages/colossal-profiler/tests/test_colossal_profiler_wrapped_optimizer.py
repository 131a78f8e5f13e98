"""``Profiler(model, optimizer)`` with a wrapped optimizer ([Note: wrapped optimizers] in
``optimizers.py``): a Booster's boosted optimizer or a sharding engine (ZeRO, Gemini) is not a
``torch.optim.Optimizer``; it used to raise TypeError. The wrappers here mirror colossalai's
(attribute delegation through ``__getattr__``, the torch optimizer in ``optim``; an engine
holding it in ``optimizer``), since the profiler's tests may not import colossalai."""

import pytest
import torch
from profiler_helpers import ManualClock

from colossal.profiler import Profiler


class Engine:
    """Like ZeroOptimizer/GeminiOptimizer: steps a torch optimizer it keeps in ``optimizer``."""

    def __init__(self, optimizer, clock):
        self.optimizer, self.clock = optimizer, clock

    def step(self):
        self.clock.advance(2.0)  # unscale / clip / refresh shards: inside the span too
        self.optimizer.step()
        return True


class Boosted:
    """Like colossalai's EngineBoostedOptimizer: delegates unknown attributes to ``optim``."""

    def __init__(self, engine, inner):
        self.optim, self.engine = inner, engine

    def __getattr__(self, name):
        return getattr(self.__dict__["optim"], name)

    def step(self):
        self.engine.step()

    def unwrap(self):
        return self.engine


@pytest.mark.parametrize("which", ["boosted", "unwrapped"])
def test_wrapped_optimizer_is_profiled(which):
    clock = ManualClock(start=10.0)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    boosted = Boosted(Engine(inner, clock), inner)
    opt = boosted if which == "boosted" else boosted.unwrap()
    with Profiler(model, opt, clock=clock, discover=False) as prof:
        model(torch.randn(2, 4)).sum().backward()
        clock.now = 20.0
        opt.step()  # [20, 22)
        prof.step()
    assert prof.summaries[0]["phases"]["optimizer"] == 2.0
    assert "step" not in opt.__dict__  # the wrapper of step() is gone after the profiler stops
    assert opt.step() is (None if which == "boosted" else True)
    assert inner.state  # the inner torch optimizer stepped (its state is what memory counts)
    # after the step: parameters and gradients (80 B each) plus Adam's two moments (160 B), found inside
    (end,) = [m for m in prof.steps[0].memory if m.label == "optimizer:end"]
    assert end.model_bytes >= 80 + 80 + 160


def test_not_an_optimizer_names_the_type():
    with pytest.raises(TypeError, match="got int"):
        Profiler(torch.nn.Linear(2, 2), 3)
