"""#31 item 6: one name and one type per knob. Every entry point that takes a precision or a byte
budget accepts the same spellings (a torch dtype or "bf16"; an int or "64MiB") with the same result,
and refuses the same bad values with a message naming the knob; GeminiPlugin and GeminiDDP default
the CPU budget alike (1 GiB, with a warning), and the plugin takes GeminiDDP's prefetch; ``prefetch``
is an int (items gathered ahead) and ``offload_optim_frac`` a fraction on ZeRO and Gemini alike."""

import dataclasses

import pytest
import torch

from colossal.gemini import GeminiDDP
from colossal.zero import ZeroConfig
from colossalai import Booster, GeminiPlugin, ZeroPlugin
from colossalai.booster.precision import Precision


def _gemini(**kw):
    return GeminiDDP(torch.nn.Linear(8, 8), **{"device_memory_budget": 1 << 20, **kw})


@pytest.mark.parametrize("spelling", [torch.bfloat16, "bf16", "bfloat16"])
def test_precision_spellings_agree_everywhere(spelling):
    assert _gemini(mixed_precision=spelling).dtype is torch.bfloat16
    assert ZeroConfig(mixed_precision=spelling).param_dtype is torch.bfloat16
    assert ZeroConfig(param_dtype=spelling).param_dtype is torch.bfloat16
    assert Booster(mixed_precision=spelling).precision is Precision.BF16


def test_bad_precision_is_refused_alike():
    for make in (
        lambda: _gemini(mixed_precision="bf17"),
        lambda: ZeroConfig(mixed_precision="bf17"),
        lambda: Booster(mixed_precision="bf17"),
    ):
        with pytest.raises(ValueError, match=r"mixed_precision must be a torch dtype or one of \[.*'bf16'.*got 'bf17'"):
            make()
    with pytest.raises(ValueError, match="param_dtype must be torch.float32"):
        ZeroConfig(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="mixed_precision='fp16' and param_dtype=torch.bfloat16 disagree"):
        ZeroConfig(mixed_precision="fp16", param_dtype="bf16")


@pytest.mark.parametrize("spelling", [1 << 20, "1MiB", "1 mib", float(1 << 20)])
def test_budget_spellings_agree_everywhere(spelling):
    gem = _gemini(device_memory_budget=spelling)
    assert gem.manager.device.budget == 1 << 20
    assert GeminiPlugin(device_memory_budget=spelling).budget == 1 << 20


def test_bad_budget_is_refused_alike():
    for make in (lambda: _gemini(device_memory_budget="2XB"), lambda: GeminiPlugin(device_memory_budget="2XB")):
        with pytest.raises(ValueError, match="device_memory_budget must look like '64MiB'.*got '2XB'"):
            make()
    for make in (lambda: _gemini(device_memory_budget=0), lambda: GeminiPlugin(device_memory_budget=0)):
        with pytest.raises(ValueError, match="device_memory_budget must be a positive byte count, got 0"):
            make()
    with pytest.raises(ValueError, match="host_memory_budget must look like"):
        GeminiPlugin(device_memory_budget="1MiB", host_memory_budget="lots", disk_dir="/tmp")


def test_gemini_plugin_and_gemini_default_the_cpu_budget_alike_and_say_so():
    from colossal.gemini import CPU_DEFAULT_BUDGET

    with pytest.warns(UserWarning, match="device_memory_budget not given and the compute device is the CPU"):
        assert GeminiDDP(torch.nn.Linear(8, 8)).manager.device.budget == CPU_DEFAULT_BUDGET
    model = torch.nn.Linear(8, 8)
    booster = Booster(plugin=GeminiPlugin())
    with pytest.warns(UserWarning, match="using 1 GiB"):
        booster.boost(model, torch.optim.Adam(model.parameters()))
    assert booster.plugin.model.manager.device.budget == CPU_DEFAULT_BUDGET


def test_gemini_plugin_passes_prefetch():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    booster = Booster(plugin=GeminiPlugin(device_memory_budget="1MiB", prefetch=0))
    boosted, *_ = booster.boost(model, torch.optim.Adam(model.parameters()))
    assert booster.plugin.model.config.prefetch == 0  # the GeminiDDP inside
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        GeminiPlugin(device_memory_budget="1MiB", prefetch=-1)


@pytest.mark.parametrize(
    "bad, error, match",
    [(True, TypeError, r"prefetch must be an int >= 0 \(0 turns it off"), (1.5, TypeError, "got float 1.5"),
     (-1, ValueError, "prefetch must be an int >= 0, got -1")],
)  # fmt: skip
def test_prefetch_is_one_int_on_zero_and_gemini(bad, error, match):
    assert ZeroConfig().prefetch == 1 and ZeroConfig(prefetch=3).prefetch == 3 and ZeroPlugin(prefetch=0)
    for make in (
        lambda: ZeroConfig(prefetch=bad),
        lambda: ZeroPlugin(stage=3, prefetch=bad),
        lambda: _gemini(prefetch=bad),
        lambda: GeminiPlugin(prefetch=bad),
    ):
        with pytest.raises(error, match=match):
            make()


def test_offload_optim_frac_is_one_fraction_on_zero_and_gemini():
    assert ZeroConfig().offload_fraction == 0.0 and not ZeroConfig().offload
    assert ZeroConfig(offload=True).offload_fraction == 1.0
    assert ZeroPlugin(offload_optim_frac=1).offload  # the shorthand and the fraction agree
    cfg = ZeroConfig(offload=True)
    assert dataclasses.replace(cfg, offload=False).offload_fraction == 0.0  # the knobs are kept as given
    half = ZeroPlugin(offload_optim_frac=0.5)
    assert half.offload_optim_frac == 0.5 and not half.offload and "offload_optim_frac=0.5" in repr(half)
    with pytest.raises(ValueError, match="offload=True means offload_optim_frac=1.0, got offload_optim_frac=0.5"):
        ZeroConfig(offload=True, offload_optim_frac=0.5)
    for make in (
        lambda: ZeroConfig(offload_optim_frac=1.5),
        lambda: ZeroPlugin(offload_optim_frac=1.5),
        lambda: _gemini(placement="static", offload_optim_frac=1.5),
        lambda: GeminiPlugin(offload_optim_frac=1.5),
    ):
        with pytest.raises(ValueError, match=r"offload_optim_frac must be in \[0, 1\], got 1.5"):
            make()
    with pytest.raises(TypeError, match="offload_optim_frac must be a number in \\[0, 1\\], got str"):
        ZeroConfig(offload_optim_frac="all")
