"""Every engine's optimizer state speaks ``torch.optim``'s contract (issue 26, items 1-3).

A model this repository never saw: a tied weight, a LayerNorm, a parameter no forward uses, two
param groups with their own hyperparameters. On 1 and 2 ranks, for every plugin: the state a
boosted run exports (``plugin.optimizer_state_dict``) has no entry for the unused parameter and a
``step`` in every entry, and loads into a plain ``torch.optim.AdamW``, which then trains exactly as
the uninterrupted run; and a plain AdamW's state loads into the engine, which then trains exactly
as plain PyTorch. Every rank sees the same batch, so the data-parallel run is the single-process
run. Tolerance: fp32 1e-5 relative (the engines' reduction order differs from one process by a few
ulps).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colossal.comm.testing import run_distributed
from colossalai import Booster
from colossalai.booster.registry import make_plugin

V, H, STEPS = 16, 8, 3


def specs(tmp: str) -> dict[str, tuple[str, dict]]:
    """Plugin name and keyword arguments of every engine under test."""
    fracs = {f"disk_{kind}_frac": 0.5 for kind in ("param", "grad", "optim")}  # the last chunks on disk
    disk = {"disk_dir": tmp, "placement": "static", "offload_param_frac": 1.0, "chunk_size": 128, **fracs}
    disk["device_memory_budget"] = 1 << 20
    return {
        "ddp": ("ddp", {"find_unused_parameters": True}),
        "zero1": ("zero", {"stage": 1}),
        "zero2-offload": ("zero", {"stage": 2, "offload": True}),
        "zero3": ("zero", {"stage": 3}),
        "gemini": ("gemini", {"chunk_size": 256}),
        "gemini-disk": ("gemini", disk),
    }


class TiedNet(nn.Module):
    """Embedding tied to the output projection, a LayerNorm, and ``unused`` (no forward reads it)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, idx):
        return self.head(self.norm(torch.tanh(self.body(self.emb(idx)))))


def make(seed: int):
    torch.manual_seed(seed)
    model = TiedNet()
    decay = [p for n, p in model.named_parameters() if n in ("emb.weight", "body.weight")]
    rest = [p for n, p in model.named_parameters() if n not in ("emb.weight", "body.weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]
    return model, torch.optim.AdamW(groups, lr=1e-2)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (8, 4), generator=g), torch.randint(0, V, (8, 4), generator=g)


def loss_of(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def plain_step(model, opt, step: int) -> float:
    loss = loss_of(model(batch(step)[0]), batch(step)[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def to_torch(named: dict, model: nn.Module, opt) -> dict:
    """A name-keyed optimizer state (what the plugins export) as ``opt.state_dict()`` lays it out."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    param = dict(model.named_parameters(remove_duplicate=False))
    groups = [
        {**{k: v for k, v in sg.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
        for g, sg in zip(opt.param_groups, named["param_groups"], strict=True)
    ]
    return {"state": {index[id(param[n])]: v for n, v in named["state"].items()}, "param_groups": groups}


def to_named(sd: dict, model: nn.Module, opt) -> dict:
    """Inverse of :func:`to_torch`: each parameter under its first name."""
    first = {}
    for n, p in model.named_parameters():
        first.setdefault(id(p), n)
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = [
        {**{k: v for k, v in sg.items() if k != "params"}, "params": [first[id(params[i])] for i in sg["params"]]}
        for sg in sd["param_groups"]
    ]
    return {"state": {first[id(params[i])]: v for i, v in sd["state"].items()}, "param_groups": groups}


def boost(spec, seed: int):
    name, kwargs = spec
    booster = Booster(plugin=make_plugin(name, **kwargs))
    model, opt = make(seed)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def boosted_step(booster, model, opt, step: int) -> float:
    loss = loss_of(model(batch(step)[0]), batch(step)[1])
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    return loss.item()


def contract(tmp: str) -> dict:
    """On every rank: per engine, the failures of export -> plain and plain -> engine."""
    model, opt = make(0)
    ref = [plain_step(model, opt, s) for s in range(STEPS)]
    ref_params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    plain2, opt2 = make(0)
    for s in range(STEPS - 1):
        plain_step(plain2, opt2, s)
    plain_state = to_named(opt2.state_dict(), plain2, opt2)
    out = {}
    for key, spec in specs(tmp).items():
        wrong = []
        # engine -> plain torch
        booster, bm, bo = boost(spec, 0)
        for s in range(STEPS - 1):
            boosted_step(booster, bm, bo, s)
        if key == "gemini-disk" and not any(c.on_disk for c in booster.plugin.model.manager.chunks):
            wrong.append("no chunk is on disk: the disk tier is not under test")
        named = booster.optimizer_state_dict(bo)
        if "unused" in named["state"]:
            wrong.append(f"an entry for a parameter that never had a gradient: {sorted(named['state']['unused'])}")
        wrong += [f"{n} has no step" for n, e in named["state"].items() if "step" not in e]
        if [g["lr"] for g in named["param_groups"]] != [1e-2, 5e-3]:
            wrong.append(f"param groups lost their lr: {named['param_groups']}")
        model_sd = bm.state_dict()
        plain, popt = make(1)
        plain.load_state_dict(model_sd)
        popt.load_state_dict(to_torch(named, plain, popt))
        got = plain_step(plain, popt, STEPS - 1)
        if abs(got - ref[-1]) > 1e-5 * abs(ref[-1]):
            wrong.append(f"plain AdamW from its state: loss {got}, uninterrupted {ref[-1]}")
        # plain torch -> engine
        booster, bm, bo = boost(spec, 1)
        bm.load_state_dict(plain2.state_dict())
        booster.load_optimizer_state_dict(bo, copy.deepcopy(plain_state))  # torch may alias what it loads
        got = boosted_step(booster, bm, bo, STEPS - 1)
        if abs(got - ref[-1]) > 1e-5 * abs(ref[-1]):
            wrong.append(f"engine from plain AdamW's state: loss {got}, plain {ref[-1]}")
        after = bm.state_dict()
        far = [n for n, t in ref_params.items() if not torch.allclose(after[n], t, rtol=1e-5, atol=1e-6)]
        if far:
            wrong.append(f"engine from plain AdamW's state: parameters differ from plain PyTorch: {far}")
        if "unused" in booster.optimizer_state_dict(bo)["state"]:
            wrong.append("loading plain state gave the unused parameter state")
        out[key] = wrong
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_every_engine_keeps_torchs_optimizer_state_contract(tmp_path, world):
    results = run_distributed(contract, world, str(tmp_path), timeout=300)
    assert sorted(results[0]) == sorted(specs("")), results[0]
    wrong = [f"{k}: {w}" for k, ws in results[0].items() for w in ws]
    assert not wrong, "\n".join(wrong)


def save_all(root: str) -> None:
    """Every engine saves after STEPS - 1 steps (``Booster.save_optimizer``)."""
    for key, spec in specs(root).items():
        booster, model, opt = boost(spec, 0)
        for s in range(STEPS - 1):
            boosted_step(booster, model, opt, s)
        booster.save_optimizer(opt, root, name=key)


def load_all(root: str) -> dict:
    """Every engine loads every engine's checkpoint and takes the last step: its loss, and whether
    the parameter that never had a gradient came back without state."""
    out = {}
    for saver in specs(root):
        for loader, spec in specs(root).items():
            booster, model, opt = boost(spec, 1)  # other weights: the load must replace them
            booster.load_optimizer(opt, f"{root}/{saver}")
            loss = boosted_step(booster, model, opt, STEPS - 1)
            out[saver, loader] = (loss, "unused" in booster.optimizer_state_dict(opt)["state"])
    return out


@pytest.mark.parametrize("saved,loaded", [(2, 1), (1, 2)])
def test_checkpoints_move_between_every_engine_and_world_size(tmp_path, saved, loaded):
    model, opt = make(0)
    ref = [plain_step(model, opt, s) for s in range(STEPS)][-1]
    run_distributed(save_all, saved, str(tmp_path), timeout=300)
    got = run_distributed(load_all, loaded, str(tmp_path), timeout=300)[0]
    assert len(got) == len(specs("")) ** 2
    wrong = [
        f"{a} ({saved} ranks) -> {b} ({loaded}): loss {loss} (uninterrupted {ref}){', state for unused' * stray}"
        for (a, b), (loss, stray) in got.items()
        if abs(loss - ref) > 1e-5 * abs(ref) or stray
    ]
    assert not wrong, "\n".join(wrong)


def engines_save_booster_loads(root: str) -> dict:
    """``colossal.zero`` / ``colossal.gemini`` save with their own ``save_sharded``; the DDP Booster
    loads each (item 3: the hyperparameters every reader of the format reads are there)."""
    from colossal.gemini import GeminiDDP, GeminiOptimizer
    from colossal.gemini import save_sharded as gemini_save
    from colossal.zero import ZeroOptimizer

    def gemini(model, opt):
        gem = GeminiDDP(model, chunk_size=256, device_memory_budget=1 << 20)
        engine = GeminiOptimizer(opt, gem)
        return gem, engine, lambda path: gemini_save(path, gem, engine)

    def zero(model, opt):
        engine = ZeroOptimizer(opt, model, stage=3)
        return model, engine, engine.save_sharded

    out = {}
    for key, wrap in (("gemini", gemini), ("zero3", zero)):
        model, opt = make(0)
        model, engine, save = wrap(model, opt)
        for s in range(STEPS - 1):
            x, y = batch(s)
            engine.backward(loss_of(model(x), y))
            engine.step()
            engine.zero_grad()
        save(f"{root}/{key}")
        booster, bm, bo = boost(("ddp", {"find_unused_parameters": True}), 1)
        booster.load_optimizer(bo, f"{root}/{key}")
        out[key] = (boosted_step(booster, bm, bo, STEPS - 1), "unused" in booster.optimizer_state_dict(bo)["state"])
    return out


def test_an_engines_own_checkpoint_loads_through_the_booster(tmp_path):
    model, opt = make(0)
    ref = [plain_step(model, opt, s) for s in range(STEPS)][-1]
    got = run_distributed(engines_save_booster_loads, 2, str(tmp_path), timeout=120)[0]
    for key, (loss, stray) in got.items():
        assert abs(loss - ref) <= 1e-5 * abs(ref) and not stray, (key, loss, ref, stray)


def _scheduled(step_fn, opt, schedulers) -> list[float]:
    """``STEPS`` steps, every scheduler stepped after each; the losses."""
    losses = []
    for s in range(STEPS):
        losses.append(step_fn(s))
        for sched in schedulers:
            sched.step(losses[-1]) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()
    return losses


def _schedulers(opt) -> list:
    """Three torch schedulers at once: StepLR, OneCycleLR (reads ``defaults``' betas), ReduceLROnPlateau."""
    lrs = torch.optim.lr_scheduler
    return [
        lrs.StepLR(opt, 1, gamma=0.5),
        lrs.OneCycleLR(opt, max_lr=[2e-2, 1e-2], total_steps=STEPS + 1),
        lrs.ReduceLROnPlateau(opt, patience=0, factor=0.5),
    ]


def torch_surface(tmp: str) -> dict:
    """Per wrapped optimizer (every plugin's boosted one, and ZeRO's and Gemini's own): the ways it
    departs from a ``torch.optim.Optimizer`` under torch's LR schedulers, step hooks and state dicts."""
    from colossal.gemini import GeminiDDP, GeminiOptimizer
    from colossal.zero import ZeroOptimizer

    model, opt = make(0)
    ref = _scheduled(lambda s: plain_step(model, opt, s), opt, _schedulers(opt))
    ref_lrs, ref_state = [g["lr"] for g in opt.param_groups], opt.state_dict()

    def engine_steps(model, engine):
        def step(s):
            x, y = batch(s)
            loss = loss_of(model(x), y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            return loss.item()

        return step

    def own(key):
        """ZeRO's or Gemini's own optimizer in a user's loop: (step function, the engine)."""
        model, opt = make(0)
        if key == "zero3-own":
            engine = ZeroOptimizer(opt, model, stage=3)
            return engine_steps(model, engine), engine
        gem = GeminiDDP(model, chunk_size=256, device_memory_budget=1 << 20)
        engine = GeminiOptimizer(opt, gem)
        return engine_steps(gem, engine), engine

    out = {}
    for key in [*specs(tmp), "zero3-own", "gemini-own"]:
        if key.endswith("-own"):
            step_fn, wrapped = own(key)
        else:
            booster, bm, wrapped = boost(specs(tmp)[key], 0)
            step_fn = lambda s, b=booster, m=bm, o=wrapped: boosted_step(b, m, o, s)  # noqa: E731
        wrong = []
        if not isinstance(wrapped, torch.optim.Optimizer):
            out[key] = [f"{type(wrapped).__name__} is not a torch.optim.Optimizer"]
            continue
        calls = []
        wrapped.register_step_post_hook(lambda o, args, kwargs, calls=calls: calls.append(1))
        got = _scheduled(step_fn, wrapped, _schedulers(wrapped))
        if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(got, ref, strict=True)):
            wrong.append(f"losses {got}, plain torch {ref}")
        if [g["lr"] for g in wrapped.param_groups] != ref_lrs:
            wrong.append(f"lr {[g['lr'] for g in wrapped.param_groups]}, plain torch {ref_lrs}")
        if len(calls) != STEPS:
            wrong.append(f"step post-hook ran {len(calls)} times in {STEPS} steps")
        sd = wrapped.state_dict()
        if sorted(sd["state"]) != sorted(ref_state["state"]):
            wrong.append(f"state_dict() indices {sorted(sd['state'])}, plain torch {sorted(ref_state['state'])}")
        else:
            plain, popt = make(1)
            popt.load_state_dict(sd)  # torch's own loader checks groups and sizes
            far = [
                (i, k)
                for i, e in ref_state["state"].items()
                for k, v in e.items()
                if not torch.allclose(torch.as_tensor(sd["state"][i][k]), torch.as_tensor(v), rtol=1e-5, atol=1e-7)
            ]
            if far:
                wrong.append(f"state_dict() entries differ from plain torch: {far}")
            wrapped.load_state_dict(ref_state)  # and plain torch's state loads back
        try:
            wrapped.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
            wrong.append("add_param_group after wrapping was accepted")
        except NotImplementedError:
            pass
        out[key] = wrong
    return out


def test_wrapped_optimizers_are_torch_optimizers_for_schedulers_hooks_and_state(tmp_path):
    """Issue 31 item 4: torch's LR schedulers (StepLR, OneCycleLR, ReduceLROnPlateau together) run on
    every wrapped optimizer directly and give plain torch's learning rates and losses; step hooks
    fire once per step; ``state_dict()`` is torch's form (loads into plain AdamW) and torch's loads
    back. Two ranks seeing the same batch = the single-process run; fp32, 1e-5 relative."""
    results = run_distributed(torch_surface, 2, str(tmp_path), timeout=300)
    wrong = [f"{k}: {w}" for k, ws in results[0].items() for w in ws]
    assert not wrong, "\n".join(wrong)
