"""A boosted model's ``state_dict()`` is the model's state in a plain process, also under Gemini,
whose parameters live in chunks outside the module tree (it returned ``{}`` before), under the
user's own names under every plugin (DDP's read ``module.module.`` before)."""

import copy

import pytest
import torch
from torch import nn

from colossal.comm.testing import run_distributed
from colossalai import Booster, GeminiPlugin, TorchDDPPlugin, TorchFSDPPlugin, ZeroPlugin


class _Net(nn.Module):  # a user's own names, a tied weight, an unused parameter, a BatchNorm buffer
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.head(self.body(self.emb(x).mean(1)))


def _train(model, opt, backward, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randint(0, 50, (8, 5)), torch.randint(0, 50, (8,))
        backward(nn.functional.cross_entropy(model(x), y), opt)
        opt.step()
        opt.zero_grad()


def test_gemini_boosted_state_dict_is_the_models():
    torch.manual_seed(0)
    ref = _Net()
    plain = copy.deepcopy(ref)
    _train(plain, torch.optim.Adam(plain.parameters(), 1e-2), lambda loss, _: loss.backward())
    booster = Booster(plugin=GeminiPlugin(device_memory_budget="64MiB"))
    mine = copy.deepcopy(ref)
    model, opt, *_ = booster.boost(mine, torch.optim.Adam(mine.parameters(), 1e-2))
    _train(model, opt, booster.backward)
    got, want = model.state_dict(), plain.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(got["unused"], torch.ones(3))  # no gradient: untouched, as in PyTorch
    fresh = _Net()
    fresh.load_state_dict(got)  # strict: loads into the plain module
    model.load_state_dict(want)  # and back, strict


def test_gemini_refuses_an_optimizer_over_another_models_parameters():
    ref = _Net()
    with pytest.raises(ValueError, match=r"optimizer holds 6 parameter\(s\) that are not the model's"):
        Booster(plugin=GeminiPlugin(device_memory_budget=1 << 26)).boost(
            copy.deepcopy(ref), torch.optim.Adam(ref.parameters())
        )


def _boosted_names(plugin_names=("ddp", "zero", "fsdp")):
    """Per plugin: the boosted model's state-dict keys and parameter names against the plain
    model's, and whether its state loads strictly into a plain model and back (also through a
    parent module that holds the boosted model)."""
    plugins = {"ddp": TorchDDPPlugin, "zero": lambda: ZeroPlugin(stage=2), "fsdp": TorchFSDPPlugin}
    out = {}
    for name in plugin_names:
        torch.manual_seed(0)
        ref = _Net()
        booster = Booster(plugin=plugins[name]())
        mine = copy.deepcopy(ref)
        model, opt, *_ = booster.boost(mine, torch.optim.Adam(mine.parameters(), 1e-2))
        _train(model, opt, booster.backward, steps=1)
        state = model.state_dict()
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
        plain = _Net()
        plain.load_state_dict(full)  # strict
        model.load_state_dict(state)  # and back, strict, the user's names
        outer = nn.ModuleDict({"net": model})
        outer.load_state_dict(outer.state_dict())  # nested: the parent walks the wrappers' tree
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "unused"'):
            model.load_state_dict({k: v for k, v in state.items() if k != "unused"})
        out[name] = (
            sorted(state) == sorted(ref.state_dict()),
            [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()],
            [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()],
            all(torch.equal(full[k].cpu(), v) for k, v in plain.state_dict().items()),
        )
    return out


def test_ddp_boosted_state_dict_has_the_users_keys_one_rank():
    assert _boosted_names(("ddp",)) == {"ddp": (True, True, True, True)}


def test_boosted_state_dict_has_the_users_keys_two_ranks():
    """DDP (``module.module.`` before), ZeRO and FSDP on 2 gloo ranks."""
    for got in run_distributed(_boosted_names, 2, timeout=180):
        assert got == {name: (True, True, True, True) for name in ("ddp", "zero", "fsdp")}
