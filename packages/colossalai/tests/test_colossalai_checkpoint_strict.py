"""Strict loading, like ``load_state_dict``, for every plugin and both Booster entry points.

A checkpoint of a 3-block model into a 2-block one (unexpected entries), of a 2-block model into a
3-block one (missing entries) and of a (4, 6) weight into a (6, 4) one (same element count) each
raise one CheckpointMismatchError listing every offending entry with shapes, on every rank, and
leave the model as it was; ``strict=False`` loads what matches and returns the lists (a mis-shaped
entry stays an error, as in torch).
"""

import pytest
import torch
from torch import nn

from colossal.comm.testing import run_distributed
from colossalai import Booster
from colossalai.booster.registry import make_plugin
from colossalai.checkpoint import CheckpointMismatchError

PLUGINS = {
    "ddp": {},
    "fsdp": {},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "gemini": {},
}


def _boost(spec: str, model: nn.Module, step: bool = True):
    booster = Booster(plugin=make_plugin("zero" if spec.startswith("zero") else spec, **PLUGINS[spec]))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optim, *_ = booster.boost(model, optim)
    if step:  # the optimizer has state to save
        booster.backward(model(torch.randn(3, 4)).pow(2).mean(), optim)
        optim.step()
        optim.zero_grad()
    return booster, model, optim


def _blocks(n: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def _full(booster, model) -> dict[str, torch.Tensor]:
    """The whole model state (collective); FSDP hands it to rank 0 only."""
    return {k: v.detach().cpu().clone() for k, v in booster.plugin.full_model_state_dict(model.module).items()}


def _same(a: dict, b: dict, names) -> bool:
    return all(torch.equal(a[n], b[n]) for n in names if n in a and n in b)


def strict_cases(spec: str, root: str, with_optimizer: bool) -> dict:
    def load(booster, model, optim, path, **kw):
        if with_optimizer:
            return booster.load_optimizer(optim, path, **kw)
        return booster.load_model(model, path, **kw)

    out = {}
    b3, m3, o3 = _boost(spec, _blocks(3, 0))
    saved3 = _full(b3, m3)
    b3.save_optimizer(o3, root, name="three")
    b2, m2, o2 = _boost(spec, _blocks(2, 1))
    saved2 = _full(b2, m2)
    b2.save_optimizer(o2, root, name="two")

    # 3 blocks into 2: unexpected entries, nothing modified; non-strict loads blocks 0-1
    bb, mm, oo = _boost(spec, _blocks(2, 2))
    before = _full(bb, mm)
    with pytest.raises(CheckpointMismatchError) as err:
        load(bb, mm, oo, f"{root}/three")
    out["unexpected_error"] = str(err.value)
    out["unchanged"] = _same(before, _full(bb, mm), before)
    result = load(bb, mm, oo, f"{root}/three", strict=False)
    out["unexpected"] = result.unexpected
    out["loaded"] = _same(saved3, _full(bb, mm), ["0.weight", "0.bias", "1.weight", "1.bias"])

    # 2 blocks into 3: missing entries; non-strict leaves block 2 as it was
    bb, mm, oo = _boost(spec, _blocks(3, 3))
    before = _full(bb, mm)
    with pytest.raises(CheckpointMismatchError) as err:
        load(bb, mm, oo, f"{root}/two")
    out["missing_error"] = str(err.value)
    result = load(bb, mm, oo, f"{root}/two", strict=False)
    out["missing"] = result.missing
    after = _full(bb, mm)
    out["loaded_missing"] = _same(saved2, after, ["0.weight", "1.weight"]) and _same(before, after, ["2.weight"])

    # (4, 6) into (6, 4): mis-shaped, an error even when not strict
    torch.manual_seed(4)
    bw, mw, ow = _boost(spec, nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 6, bias=False)))
    bw.save_optimizer(ow, root, name="wide")
    torch.manual_seed(5)
    bt, mt, ot = _boost(spec, nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(6, 4, bias=False)), step=False)
    for strict in (True, False):
        with pytest.raises(CheckpointMismatchError) as err:
            load(bt, mt, ot, f"{root}/wide", strict=strict)
    out["shape_error"] = str(err.value)
    return out


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["load_model", "load_optimizer"])
@pytest.mark.parametrize("spec", list(PLUGINS))
def test_strict_load(tmp_path, spec, with_optimizer):
    results = run_distributed(strict_cases, 2, spec, str(tmp_path), with_optimizer, timeout=240)
    for r in results:  # every rank raised the same errors and got the same lists
        assert r["unexpected_error"] == results[0]["unexpected_error"]
        assert "unexpected: model/2.bias, model/2.weight" in r["unexpected_error"], r["unexpected_error"]
        assert r["unchanged"] and r["loaded"] and r["loaded_missing"]
        assert r["unexpected"][:2] == ["model/2.bias", "model/2.weight"]
        assert "2 missing: model/2.bias, model/2.weight" in r["missing_error"], r["missing_error"]
        assert r["missing"] == ["model/2.bias", "model/2.weight"]
        assert "model/1.weight: checkpoint (6, 4) float32, model (4, 6) float32" in r["shape_error"], r["shape_error"]
    if with_optimizer:
        assert "optim/2.weight/exp_avg" in results[0]["unexpected"], results[0]["unexpected"]


def _bn_setup(seed: int):
    torch.manual_seed(seed)
    booster = Booster(plugin=make_plugin("ddp"))
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optim, *_ = booster.boost(model, optim)
    booster.backward(model(torch.randn(6, 4)).sum(), optim)
    optim.step()
    return booster, model, optim


def test_model_only_checkpoint_into_load_optimizer_says_so(tmp_path):
    booster, model, optim = _bn_setup(0)
    ckpt = booster.save_model(model, tmp_path)
    with pytest.raises(CheckpointMismatchError, match="model-only checkpoint"):
        booster.load_optimizer(optim, ckpt)


def test_checkpoint_of_the_older_layout_still_loads(tmp_path):
    """Before: ZeRO/Gemini wrote a 0-dim buffer as a 1-element ``@0`` piece and no entry table."""
    import torch.distributed.checkpoint as dcp

    booster, model, optim = _bn_setup(0)
    pieces = booster.plugin.checkpoint_pieces(model.module, optim.unwrap())
    pieces["model/1.num_batches_tracked@0"] = pieces.pop("model/1.num_batches_tracked").reshape(1)
    dcp.save(pieces, checkpoint_id=str(tmp_path / "old" / "dcp"), no_dist=True)
    booster2, model2, optim2 = _bn_setup(1)
    booster2.load_optimizer(optim2, tmp_path / "old")
    saved, loaded = (b.plugin.unwrap(m.module).state_dict() for b, m in ((booster, model), (booster2, model2)))
    assert all(torch.equal(saved[k], loaded[k]) for k in saved) and int(loaded["1.num_batches_tracked"]) == 1


def hybrid_cases(root: str) -> dict:
    """The hybrid plugin applies its GPT plan, so its case runs on the tiny GPT (tp=2)."""
    from colossalai.models import build_gpt

    def boost(**cfg):
        booster = Booster(plugin=make_plugin("hybrid", tp_size=2))
        model = build_gpt("tiny", seed=0, **cfg)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optim, *_ = booster.boost(model, optim)
        return booster, model, optim

    out = {}
    b3, m3, o3 = boost(n_layer=3)
    b3.save_optimizer(o3, root, name="three")
    b2, m2, o2 = boost(n_layer=2)
    for entry, load in (("model", lambda **kw: b2.load_model(m2, f"{root}/three", **kw)),
                        ("optimizer", lambda **kw: b2.load_optimizer(o2, f"{root}/three", **kw))):  # fmt: skip
        with pytest.raises(CheckpointMismatchError) as err:
            load()
        out[entry] = str(err.value), load(strict=False).unexpected
    bw, mw, ow = boost(n_layer=2, block_size=32)  # wpe (32, 32) against the saved (64, 32)
    with pytest.raises(CheckpointMismatchError) as err:
        bw.load_model(mw, f"{root}/three", strict=False)
    out["shape"] = str(err.value)
    return out


def test_strict_load_hybrid(tmp_path):
    for r in run_distributed(hybrid_cases, 2, str(tmp_path), timeout=240):
        for message, unexpected in (r["model"], r["optimizer"]):
            assert "unexpected: model/blocks.2.attn" in message, message
            assert "model/blocks.2.mlp.fc_in.weight" in unexpected, unexpected
        assert "model/wpe.weight: checkpoint (64, 32) float32, model (32, 32) float32" in r["shape"], r["shape"]
