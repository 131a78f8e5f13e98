"""ZeRO's state methods follow torch: ``load_full_model_state_dict`` is strict (missing or
unexpected keys and shape mismatches are one RuntimeError before anything changes; ``strict=False``
returns ``_IncompatibleKeys`` and keeps what the state lacks) and loads buffers (it ignored them);
the flat-slice pieces keep 0-dim buffers whole under ``model/<name>``."""

import pytest
import torch
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.zero import ZeroOptimizer


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _plain_state(seed: int) -> dict:
    plain = _model(seed)
    plain[1].running_mean.uniform_()
    plain[1].num_batches_tracked.fill_(7)
    return plain.state_dict()


def strict_cases(stage: int) -> dict:
    model = _model(0)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=stage)
    state = _plain_state(1)
    out = {"pieces": sorted(k for k in zero.sharded_state_dict() if "num_batches" in k)}
    before = zero.full_model_state_dict()
    bad = {k: v for k, v in state.items() if k != "2.bias"} | {"3.weight": torch.zeros(1)}
    with pytest.raises(
        RuntimeError,
        match=r'Missing key\(s\) in state_dict: "2.bias"[\s\S]*Unexpected key\(s\) in state_dict: "3.weight"',
    ):
        zero.load_full_model_state_dict(bad)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in zero.full_model_state_dict().items())
    result = zero.load_full_model_state_dict(bad, strict=False)
    out["lists"] = (result.missing_keys, result.unexpected_keys)
    after = zero.full_model_state_dict()
    out["kept"] = torch.equal(after["2.bias"], before["2.bias"]) and torch.equal(after["2.weight"], state["2.weight"])
    out["buffers"] = all(torch.equal(after[k], state[k]) for k in ("1.running_mean", "1.num_batches_tracked"))
    wrong = dict(state, **{"0.weight": torch.zeros(4, 8)})
    for strict in (True, False):
        with pytest.raises(
            RuntimeError, match=r"size mismatch for 0.weight.*torch.Size\(\[4, 8\]\).*torch.Size\(\[8, 4\]\)"
        ):
            zero.load_full_model_state_dict(wrong, strict=strict)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_load_full_model_state_dict_is_strict_and_loads_buffers(stage):
    for r in run_distributed(strict_cases, 2, stage, timeout=120):
        assert r["pieces"] == ["model/1.num_batches_tracked"], r["pieces"]
        assert r["unchanged"] and r["kept"] and r["buffers"], r
        assert r["lists"] == (["2.bias"], ["3.weight"])
