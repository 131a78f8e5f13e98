"""A dropped ZeroOptimizer frees its reducer, its gradient buckets and (stage 3) its model.

The gradient hooks on the parameters are kept in C++, where Python's cycle collector cannot see them
(``[Note: weak hooks]`` in ``colossal.comm.hooks``); before they were weak, every engine's reducer
(with its gradient buffers) outlived the user's last reference, and under stage 3 the whole model.
"""

import gc
import weakref

from colossal_zero_testutil import loss_of, make_model, make_optimizer, rank_batch

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer


def _alive_after_drop() -> list:
    alive = []
    for stage in (1, 2, 3):
        model = make_model()
        zero = ZeroOptimizer(make_optimizer(model), model, stage=stage)
        x, y = rank_batch(0, 0, 1, 1, 0)
        zero.backward(loss_of(model, x, y))
        zero.step()
        zero.zero_grad()
        refs = {"zero": weakref.ref(zero), "reducer": weakref.ref(zero.reducer), "model": weakref.ref(model)}
        del zero, model
        gc.collect()
        alive += [(stage, name) for name, ref in refs.items() if ref() is not None]
    return alive


def test_a_dropped_engine_frees_its_buffers_and_model():
    assert run_distributed(_alive_after_drop, 1, timeout=120)[0] == []
