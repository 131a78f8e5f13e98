"""Hugging Face models (GPT-2 with its tied ``wte``/``lm_head``, Llama with grouped-query
attention and RoPE; BERT masked LM and ViT classifier on pp=2 only; tiny random configs built
locally) under ``HybridParallelPlugin(pp_size=2)``: pp=2 on 2 ranks and pp2 x tp2 on 4 ranks train
3 steps through ``booster.execute_pipeline`` with padded rows and their ``attention_mask`` (left
padding for the causal LMs, so the mask matters),
against the unwrapped model trained by plain PyTorch on its own ``loss`` (``model(**batch).loss``).
A ``save_pretrained`` folder (GPT-2, Llama) loaded under pp=2, trained and exported loads strictly
with ``transformers``' ``from_pretrained`` and gives the logits of the same training in plain
PyTorch. The same ``execute_pipeline`` loop drives GPT-2 under tp=2 without a pipeline
(``model(**x)``, the output's logits). Bad configurations raise before any collective (at boost) or
any transfer (per step).

Tolerance: fp32, 1e-5 relative on every step's loss and every final parameter, 1e-7 absolute for
elements near zero (the exported logits: 1e-6 absolute, logits are O(1)): the pipeline accumulates
the micro-batches' gradients in ``.grad`` instead of one batched product and tp sums partial
products, so the order of fp32 reductions is all that differs. The optimizer is SGD with
momentum, whose update is linear in the gradient: AdamW's first update is ``lr * g / |g|``, which
turns a round-off-sized gradient into an ``lr``-sized step (GPT-2's key bias has a gradient of
exactly zero in exact arithmetic, softmax ignoring a shift of a query's scores, and AdamW moved
its elements by up to 2e-5 differently between two reduction orders; the losses matched at 1e-5
under AdamW as well).

One spawn per world size runs every case and reports each case's error, so one failure does not
hide the others.
"""

import pathlib

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hf_models import batches as right_padded_batches  # noqa: E402
from hf_models import build, loss  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import Booster, HybridParallelPlugin  # noqa: E402

PP = dict(pp_size=2, num_microbatches=2)
CASES = {
    2: {
        ("gpt2", "pp2"): dict(tp_size=1, **PP),
        ("llama", "pp2-gpipe-m4"): dict(tp_size=1, pp_size=2, num_microbatches=4, pp_schedule="gpipe"),
        ("bert", "pp2-zero_bubble"): dict(tp_size=1, pp_schedule="zero_bubble", **PP),
        ("vit", "pp2"): dict(tp_size=1, **PP),
        ("gpt2", "tp2, no pp: the same loop"): dict(tp_size=2),  # execute_pipeline without a pipeline
    },
    4: {
        ("gpt2", "pp2xtp2"): dict(tp_size=2, **PP),
        ("llama", "pp2xtp2"): dict(tp_size=2, **PP),
    },
}


def batches(family: str) -> list[dict]:
    """``hf_models``' batches, with the padded rows of the causal LMs padded on the left: with right
    padding a causal model's real tokens never see the pads, so a dropped ``attention_mask`` would
    go unnoticed; with left padding it changes every loss."""
    out = right_padded_batches(family)
    if family in ("gpt2", "llama"):
        for b in out:
            for k in ("input_ids", "attention_mask", "labels"):
                b[k][1::2] = b[k][1::2].roll(3, dims=1)
    return out


def _optimizer(model):
    """SGD with momentum (see the module docstring for why not AdamW here)."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss of ``transformers`` (next-token targets, ``-100`` ignored, mean)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BERT's masked LM loss (``-100`` ignored, mean)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


CRITERIA = {"gpt2": causal_lm_loss, "llama": causal_lm_loss, "bert": masked_lm_loss, "vit": F.cross_entropy}


def _x(batch: dict):
    if "pixel_values" in batch:
        return batch["pixel_values"]
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _dense(family: str, folder=None):
    """Plain PyTorch: the model (from ``folder`` when given) trained 3 steps on its own loss;
    returns ``(losses, model)``."""
    torch.manual_seed(0)
    model = build(family) if folder is None else transformers.AutoModelForCausalLM.from_pretrained(folder)
    optim = _optimizer(model)
    losses = []
    for batch in batches(family):
        value = loss(model, batch)
        value.backward()
        optim.step()
        optim.zero_grad()
        losses.append(value.item())
    return losses, model


def _pipeline(kwargs: dict, family: str, folder=None):
    """``(booster, boosted model, losses)`` after 3 pipeline steps (weights loaded from ``folder``)."""
    torch.manual_seed(0)
    booster = Booster(plugin=HybridParallelPlugin(**kwargs))
    model = build(family)
    optim = _optimizer(model)
    model, optim, *_ = booster.boost(model, optim)
    if folder is not None:
        booster.load_pretrained(model, folder)
    losses = []
    for batch in batches(family):
        step = booster.execute_pipeline((_x(batch), batch["labels"]), model, CRITERIA[family], optim)
        losses.append(step.item())
        optim.step()
        optim.zero_grad()
    return booster, model, losses


def _round_trip(family: str, root: pathlib.Path) -> dict:
    """A ``save_pretrained`` folder -> pp=2 -> 3 steps -> ``Booster.save_pretrained``."""
    src = root / f"src-{family}"
    booster, model, losses = _pipeline(dict(tp_size=1, **PP), family, src)
    booster.save_pretrained(model, root / f"out-{family}", max_shard_size="8KB")
    return losses


def _errors() -> dict:
    """Configurations that must raise on every rank before any collective."""
    out = {}
    for name, family, kw in (
        ("layers", "gpt2", dict(tp_size=1, pp_size=2)),  # 3 layers on 2 stages
        ("mixtral", "mixtral", dict(tp_size=1, pp_size=2)),
        ("sp", "llama", dict(tp_size=1, sp_size=2, pp_size=2)),
    ):
        torch.manual_seed(0)
        if name == "layers":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64))
        else:
            model = build(family)
        try:
            Booster(plugin=HybridParallelPlugin(**kw)).boost(model, torch.optim.AdamW(model.parameters()))
            out[name] = "no error"
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    torch.manual_seed(0)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, **PP))
    model = build("gpt2")
    model, optim, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = batches("gpt2")[0]
    for name, x in (
        ("key", {**_x(batch), "token_type_ids": batch["input_ids"]}),
        ("shape", {**_x(batch), "attention_mask": batch["attention_mask"][:, :4]}),
    ):
        try:
            booster.execute_pipeline((x, batch["labels"]), model, causal_lm_loss, optim)
            out[name] = "no error"
        except ValueError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _all_cases(world: int, root: str) -> dict:
    out = {}
    for (family, name), kwargs in CASES[world].items():
        try:
            booster, model, losses = _pipeline(kwargs, family)
            state = booster.plugin.full_model_state_dict(model.module)
            out[family, name] = losses, {k: v for k, v in state.items()}
        except Exception as e:  # noqa: BLE001 (reported per case by the test)
            out[family, name] = f"{type(e).__name__}: {e}"
    if world == 2:
        for family in ("gpt2", "llama"):
            try:
                out[family, "round-trip"] = _round_trip(family, pathlib.Path(root))
            except Exception as e:  # noqa: BLE001
                out[family, "round-trip"] = f"{type(e).__name__}: {e}"
        out["errors"] = _errors()
    return out


def _close(got, want, what: str, failures: list, atol: float = 0.0) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    except AssertionError as e:
        failures.append(f"{what}: {e}")


@pytest.mark.parametrize("world", [2, 4])
def test_hf_pipeline_trains_like_plain_pytorch(world, tmp_path):
    if world == 2:  # folders written by transformers itself, before the ranks start
        for family in ("gpt2", "llama"):
            torch.manual_seed(0)
            build(family).save_pretrained(tmp_path / f"src-{family}", max_shard_size="8KB")
    results = run_distributed(_all_cases, world, world, str(tmp_path), timeout=240)
    refs = {}
    for family, _ in CASES[world]:
        ref_losses, dense = _dense(family)
        refs[family] = torch.tensor(ref_losses), {k: v.detach() for k, v in dense.state_dict().items()}
    failures = []
    for rank, got in enumerate(results):
        for (family, name), value in ((k, v) for k, v in got.items() if k != "errors" and k[1] != "round-trip"):
            if isinstance(value, str):
                failures.append(f"rank {rank} {family} {name}: {value}")
                continue
            losses, state = value
            _close(torch.tensor(losses), refs[family][0], f"rank {rank} {family} {name} losses", failures)
            ref_state = refs[family][1]
            if sorted(state) != sorted(ref_state):
                failures.append(f"rank {rank} {family} {name}: names {sorted(set(state) ^ set(ref_state))}")
                continue
            _close(state, ref_state, f"rank {rank} {family} {name} parameters", failures, atol=1e-7)
        if world == 2:
            _check_round_trips(rank, got, tmp_path, failures)
            _check_errors(rank, got["errors"], failures)
    assert not failures, "\n".join(failures)


def _check_round_trips(rank: int, got: dict, root: pathlib.Path, failures: list) -> None:
    x = batches("gpt2")[0]
    for family in ("gpt2", "llama"):
        losses = got[family, "round-trip"]
        if isinstance(losses, str):
            failures.append(f"rank {rank} {family} round trip: {losses}")
            continue
        if rank:
            continue
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(
            root / f"out-{family}", output_loading_info=True
        )
        strict = {k: v for k, v in info.items() if k != "error_msgs" and v}
        if strict or info["error_msgs"]:
            failures.append(f"{family} export is not a strict from_pretrained folder: {info}")
        dense = _dense(family, root / f"src-{family}")[1]
        with torch.no_grad():
            want, have = (m.eval()(**_x(x)).logits for m in (dense, exported))
        _close(have, want, f"{family} exported logits", failures, atol=1e-6)


def _check_errors(rank: int, errors: dict, failures: list) -> None:
    expect = {
        "layers": "ValueError: gpt2: 3 layers (transformer.h) must be divisible by pp_size=2",
        "mixtral": "NotImplementedError: mixtral: pipeline parallelism (pp_size=2) is not available",
        "sp": "NotImplementedError: llama: pipeline x sequence parallelism",
        "key": "ValueError: pipeline inputs ['token_type_ids'] are not supported",
        "shape": "ValueError: ['attention_mask'] must have the shape of input_ids (8, 8)",
    }
    for name, start in expect.items():
        if not errors[name].startswith(start):
            failures.append(f"rank {rank} error {name}: {errors[name]!r} does not start with {start!r}")
