"""Off means nothing attached: no hooks on the model or optimizer, no event observers."""

import subprocess
import sys

import pytest
import torch
from profiler_helpers import FakeSource, tiny_mlp

import colossal.comm
from colossal.profiler import Profiler, Schedule


def _hooks(model, opt):
    per_module = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    global_hooks = len(torch.nn.modules.module._global_forward_hooks) + len(
        torch.nn.modules.module._global_forward_pre_hooks
    )
    return per_module + global_hooks + len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def _train(model, opt, prof, steps):
    for _ in range(steps):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        yield _hooks(model, opt), colossal.comm.has_observers()
        prof.step()


@pytest.fixture
def setup():
    model = tiny_mlp()
    return model, torch.optim.Adam(model.parameters())


def test_disabled_attaches_nothing(setup):
    model, opt = setup
    source = FakeSource()
    with Profiler(model, opt, enabled=False, sources=[source], flops=True) as prof:
        seen = list(_train(model, opt, prof, 3))
    assert seen == [(0, False)] * 3 and source.observers == [] and prof.steps == [] and prof.step_num == 3


def test_wait_steps_and_after_schedule_attach_nothing(setup):
    model, opt = setup
    with Profiler(model, opt, schedule=Schedule(wait=2, active=1, repeat=1)) as prof:
        seen = list(_train(model, opt, prof, 5))
    hooks_on = seen[2][0]
    assert hooks_on > 0 and seen[2][1] is True  # the active step: hooks and a comm observer
    assert [s for i, s in enumerate(seen) if i != 2] == [(0, False)] * 4
    assert _hooks(model, opt) == 0 and not colossal.comm.has_observers()
    assert [r.step for r in prof.steps] == [2]


def test_exit_removes_everything_even_on_error(setup):
    model, opt = setup
    with pytest.raises(RuntimeError, match="boom"), Profiler(model, opt, flops=True):
        assert _hooks(model, opt) > 0
        model(torch.randn(2, 8))
        raise RuntimeError("boom")
    assert _hooks(model, opt) == 0 and not colossal.comm.has_observers()
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_import_does_not_import_siblings():
    code = (
        "import sys, colossal.profiler; "
        "print(sorted(m for m in sys.modules if m.startswith('colossal.') and not m.startswith('colossal.profiler')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_trailing_empty_step_is_dropped(setup):
    model, opt = setup
    with Profiler(model, opt, schedule=Schedule(active=1, repeat=0)) as prof:
        list(_train(model, opt, prof, 3))
    assert [r.step for r in prof.steps] == [0, 1, 2]  # step 3 only saw the exit: not kept
