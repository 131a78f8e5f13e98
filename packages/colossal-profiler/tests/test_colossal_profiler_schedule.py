"""The step schedule and the config's validation."""

import pytest

from colossal.profiler import Action, Profiler, ProfilerConfig, Schedule


def test_schedule_cycles_like_torch_profiler():
    s = Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    got = [s.action(i) for i in range(11)]
    n, w, r, rs = Action.NONE, Action.WARMUP, Action.RECORD, Action.RECORD_AND_SAVE
    assert got == [n, n, w, r, rs, n, w, r, rs, n, n]
    assert [s.cycle_index(i) for i in (3, 4, 7, 8)] == [0, 0, 1, 1]


def test_schedule_repeat_zero_is_forever():
    s = Schedule(wait=1, active=1, repeat=0)
    assert [s.action(i) for i in range(1000, 1004)] == [Action.NONE, Action.RECORD_AND_SAVE] * 2


@pytest.mark.parametrize("field,value", [("wait", -1), ("active", 0), ("repeat", 1.5), ("warmup", True)])
def test_schedule_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"Schedule.{field}"):
        Schedule(**{field: value})


def test_config_validation():
    with pytest.raises(ValueError, match="module_depth"):
        ProfilerConfig(module_depth=-1)
    with pytest.raises(ValueError, match="peak_flops"):
        ProfilerConfig(peak_flops=0)
    with pytest.raises(TypeError, match="register_observer"):
        ProfilerConfig(sources=[object()])
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        ProfilerConfig(schedule=(1, 1, 1))


def test_profiler_argument_errors():
    with pytest.raises(TypeError, match="either config= or keyword"):
        Profiler(config=ProfilerConfig(), comm=False)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Profiler("model")
    with pytest.raises(TypeError, match="unexpected keyword"):
        Profiler(bogus=1)
