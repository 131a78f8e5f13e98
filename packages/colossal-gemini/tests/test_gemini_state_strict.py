"""Gemini's state methods follow torch: ``load_state_dict`` is strict (missing or unexpected keys
and shape mismatches are one RuntimeError, raised before anything changes; ``strict=False``
returns ``_IncompatibleKeys`` and keeps what the state lacks), loads persistent buffers and skips
non-persistent ones; the flat-slice pieces keep 0-dim buffers whole under ``model/<name>``."""

import pytest
import torch
from torch import nn

from colossal.gemini import GeminiDDP, sharded_entries, sharded_state_dict


def _gem(seed: int) -> GeminiDDP:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    return GeminiDDP(model, placement="auto", device_memory_budget=100 << 20)


def _plain_state(seed: int) -> dict:
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    plain[1].running_mean.uniform_()
    plain[1].num_batches_tracked.fill_(7)
    return plain.state_dict()


def test_load_state_dict_loads_buffers_and_matches_torch_keys():
    gem, state = _gem(0), _plain_state(1)
    assert gem.load_state_dict(state) == torch.nn.modules.module._IncompatibleKeys([], [])
    out = gem.state_dict()
    assert set(out) == set(state)  # the non-persistent buffer is not saved, like torch
    for k, v in state.items():
        assert torch.equal(out[k], v.float() if v.is_floating_point() else v), k


def test_load_state_dict_is_strict_and_checks_before_changing():
    gem, state = _gem(0), _plain_state(1)
    before = gem.state_dict()
    bad = {k: v for k, v in state.items() if k != "2.bias"} | {"3.weight": torch.zeros(1)}
    with pytest.raises(
        RuntimeError,
        match=r'Missing key\(s\) in state_dict: "2.bias"[\s\S]*Unexpected key\(s\) in state_dict: "3.weight"',
    ):
        gem.load_state_dict(bad)
    assert all(torch.equal(before[k], v) for k, v in gem.state_dict().items())  # nothing changed
    result = gem.load_state_dict(bad, strict=False)
    assert result.missing_keys == ["2.bias"] and result.unexpected_keys == ["3.weight"]
    out = gem.state_dict()
    assert torch.equal(out["2.bias"], before["2.bias"]) and torch.equal(out["2.weight"], state["2.weight"])
    wrong = dict(state, **{"0.weight": torch.zeros(4, 8)})  # (8, 4) in the model: same numel
    for strict in (True, False):
        with pytest.raises(
            RuntimeError, match=r"size mismatch for 0.weight.*torch.Size\(\[4, 8\]\).*torch.Size\(\[8, 4\]\)"
        ):
            gem.load_state_dict(wrong, strict=strict)


def test_pieces_keep_0dim_buffers_whole():
    gem = _gem(0)
    pieces = sharded_state_dict(gem)
    assert "model/1.num_batches_tracked" in pieces and pieces["model/1.num_batches_tracked"].dim() == 0
    assert "model/1.num_batches_tracked@0" not in pieces and not any("scratch" in k for k in pieces)
    entries = sharded_entries(gem)
    assert entries["1.num_batches_tracked"] == ((), "int64") and entries["0.weight"] == ((8, 4), "float32")
