"""DynamicLossScaler / ConstantLossScaler: exact scale sequence, clamps, state_dict, validation."""

import pytest
import torch

from colossal.optim import ConstantLossScaler, DynamicLossScaler

CONFIG = dict(
    initial_scale=8.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=3,
    hysteresis=2,
    min_scale=2.0,
    max_scale=32.0,
)
# (found_inf, scale after update), derived by hand from [Note: scale sequence]; g = clean-step
# counter, h = overflow counter since the last growth.
SEQUENCE = [
    (False, 8.0),  # 1  g=1
    (False, 8.0),  # 2  g=2
    (False, 16.0),  # 3  g=3 -> grow, g=h=0
    (True, 16.0),  # 4  h=1 < 2: absorbed by hysteresis, g=0
    (False, 16.0),  # 5  g=1
    (False, 16.0),  # 6  g=2
    (False, 32.0),  # 7  g=3 -> grow
    (False, 32.0),  # 8
    (False, 32.0),  # 9
    (False, 32.0),  # 10 grow clamped at max_scale
    (True, 32.0),  # 11 h=1 absorbed
    (True, 16.0),  # 12 h=2 -> backoff
    (True, 8.0),  # 13 every further overflow backs off
    (True, 4.0),  # 14
    (True, 2.0),  # 15
    (True, 2.0),  # 16 clamped at min_scale
    (False, 2.0),  # 17 g=1
    (False, 2.0),  # 18 g=2
    (False, 4.0),  # 19 grow, h reset
    (True, 4.0),  # 20 h=1 absorbed
    (False, 4.0),  # 21 g=1
    (True, 2.0),  # 22 h=2 (overflows need not be consecutive) -> backoff; g=0
    (False, 2.0),  # 23
    (False, 2.0),  # 24
    (False, 4.0),  # 25 grow
]


def test_exact_scale_sequence():
    scaler = DynamicLossScaler(**CONFIG)
    assert scaler.scale == 8.0
    got = []
    for found_inf, _ in SEQUENCE:
        scaler.update(found_inf)
        got.append(scaler.scale)
    assert got == [s for _, s in SEQUENCE]


@pytest.mark.parametrize("cut", [1, 4, 11, 13, 20])
def test_state_dict_round_trip_mid_sequence(cut):
    scaler = DynamicLossScaler(**CONFIG)
    for found_inf, _ in SEQUENCE[:cut]:
        scaler.update(found_inf)
    sd = scaler.state_dict()
    restored = DynamicLossScaler()  # defaults: everything comes from the state dict
    restored.load_state_dict(sd)
    assert restored.state_dict() == sd
    for found_inf, expected in SEQUENCE[cut:]:
        restored.update(found_inf)
        assert restored.scale == expected


def test_hysteresis_one_backs_off_at_once_and_tensor_flag():
    scaler = DynamicLossScaler(initial_scale=4.0, hysteresis=1, growth_interval=2)
    scaler.update(torch.tensor(True))
    assert scaler.scale == 2.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 4.0


def test_scale_loss_and_unscale():
    scaler = DynamicLossScaler(initial_scale=1024.0)
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss).item() == 3072.0
    grads = [torch.randn(5) * 1024, torch.randn(2, 3, dtype=torch.float64) * 1024, None]
    expected = [g / 1024 for g in grads[:2]]
    scaler.unscale_(grads)
    for g, e in zip(grads[:2], expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_non_power_of_two_unscale_is_a_true_division():
    scaler = DynamicLossScaler(initial_scale=3.0, min_scale=1.0)
    g = torch.randn(1000)
    ref = g / 3.0
    scaler.unscale_([g])
    assert torch.equal(g, ref)


def test_constant_scaler():
    scaler = ConstantLossScaler()
    assert scaler.scale == 1.0
    scaler.update(True)
    assert scaler.scale == 1.0
    scaler = ConstantLossScaler(128.0)
    g = [torch.full((3,), 256.0)]
    scaler.unscale_(g)
    assert g[0].tolist() == [2.0, 2.0, 2.0]
    other = ConstantLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.scale == 128.0


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(initial_scale=0.0), ValueError),
        (dict(initial_scale=float("inf")), ValueError),
        (dict(initial_scale="1"), TypeError),
        (dict(growth_factor=1.0), ValueError),
        (dict(backoff_factor=1.0), ValueError),
        (dict(growth_interval=0), ValueError),
        (dict(growth_interval=1.5), TypeError),
        (dict(hysteresis=0), ValueError),
        (dict(min_scale=4.0, max_scale=2.0, initial_scale=3.0), ValueError),
        (dict(initial_scale=2.0**30), ValueError),
    ],
)
def test_validation(kwargs, exc):
    with pytest.raises(exc):
        DynamicLossScaler(**kwargs)


def test_load_state_dict_missing_keys():
    with pytest.raises(KeyError, match="growth_step"):
        DynamicLossScaler().load_state_dict({"scale": 2.0})
