"""Hugging Face models (GPT-2 with its tied ``wte``/``lm_head``, Llama with grouped-query attention
and RoPE, Mixtral, BERT masked LM and ViT classifier; tiny random configs built locally) under
``HybridParallelPlugin(pp_size=2)``: pp=2 on 2 ranks, and on 4 ranks pp2 x tp2, pp2 x dp2 with
ZeRO-1/2, the interleaved schedule, meta-device construction and (Mixtral) pp2 x ep2, train 3
steps through ``booster.execute_pipeline`` with padded rows and their ``attention_mask`` (left
padding for the causal LMs, so the mask matters), each dp rank on its rows of the global batch,
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

import math
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
INTERLEAVED = dict(tp_size=1, pp_size=2, num_microbatches=2, pp_schedule="interleaved", pp_virtual=2)
CASES = {  # (family, name) -> plugin kwargs; a "4 layers" name: 4 blocks; a "meta" name: see _build
    2: {
        ("gpt2", "pp2"): dict(tp_size=1, **PP),
        ("mixtral", "pp2"): dict(tp_size=1, **PP),
        ("llama", "pp2-gpipe-m4"): dict(tp_size=1, pp_size=2, num_microbatches=4, pp_schedule="gpipe"),
        ("bert", "pp2-zero_bubble"): dict(tp_size=1, pp_schedule="zero_bubble", **PP),
        ("vit", "pp2"): dict(tp_size=1, **PP),
        ("gpt2", "tp2, no pp: the same loop"): dict(tp_size=2),  # execute_pipeline without a pipeline
    },
    4: {
        ("gpt2", "pp2xtp2"): dict(tp_size=2, **PP),
        ("llama", "pp2xtp2"): dict(tp_size=2, **PP),
        ("bert", "pp2xtp2"): dict(tp_size=2, **PP),
        ("vit", "pp2xtp2"): dict(tp_size=2, **PP),
        ("gpt2", "pp2xdp2-zero1"): dict(tp_size=1, zero_stage=1, **PP),
        ("gpt2", "pp2xdp2-zero2"): dict(tp_size=1, zero_stage=2, **PP),
        ("llama", "pp2xdp2-zero1"): dict(tp_size=1, zero_stage=1, **PP),
        ("llama", "pp2xdp2-zero2"): dict(tp_size=1, zero_stage=2, **PP),
        ("gpt2", "pp2xdp2-interleaved, 4 layers"): INTERLEAVED,
        ("llama", "pp2xdp2-interleaved, 4 layers"): INTERLEAVED,
        ("gpt2", "pp2xtp2-meta"): dict(tp_size=2, **PP),
        ("llama", "pp2xdp2-zero1-meta"): dict(tp_size=1, zero_stage=1, **PP),
        ("mixtral", "pp2xep2"): dict(tp_size=1, ep_size=2, **PP),
        ("mixtral", "pp2xep2-zero2"): dict(tp_size=1, ep_size=2, zero_stage=2, **PP),
    },
}
"""The 4-rank cases compose the pipeline with the other axes: tp (every family), dp with ZeRO 1/2,
the interleaved schedule (virtual stages: 4 blocks on 2 ranks), meta-device construction (loaded
from a ``save_pretrained`` folder) and, for Mixtral, expert parallelism over the dp ranks."""


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


CRITERIA = {
    "gpt2": causal_lm_loss, "llama": causal_lm_loss, "mixtral": causal_lm_loss, "bert": masked_lm_loss,
    "vit": F.cross_entropy,
}  # fmt: skip


def _build(family: str, name: str = ""):
    """The tiny model of ``family``; with 4 blocks for a ``"4 layers"`` case (the interleaved
    schedule needs ``pp_size * pp_virtual`` of them); on the meta device for a ``"meta"`` case."""
    if "4 layers" in name:
        cfg = build(family).config
        setattr(cfg, "n_layer" if family == "gpt2" else "num_hidden_layers", 4)
        return type(build(family))(cfg)
    if "meta" in name:
        with torch.device("meta"):
            return build(family)
    return build(family)


def _rows(batch: dict, rank: int, n: int) -> dict:
    """Data-parallel rank ``rank``'s contiguous rows of a global batch (``n`` ranks)."""
    return {k: v[rank * (v.shape[0] // n) : (rank + 1) * (v.shape[0] // n)] for k, v in batch.items()}


def _x(batch: dict):
    if "pixel_values" in batch:
        return batch["pixel_values"]
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _dense(family: str, folder=None, name: str = ""):
    """Plain PyTorch: the model (from ``folder`` when given) trained 3 steps on its own loss;
    returns ``(losses, model)``."""
    torch.manual_seed(0)
    model = (
        _build(family, name.replace("meta", ""))
        if folder is None
        else transformers.AutoModelForCausalLM.from_pretrained(folder)
    )
    optim = _optimizer(model)
    losses = []
    for batch in batches(family):
        value = loss(model, batch)
        value.backward()
        optim.step()
        optim.zero_grad()
        losses.append(value.item())
    return losses, model


def _pipeline(kwargs: dict, family: str, folder=None, name: str = ""):
    """``(booster, boosted model, losses)`` after 3 pipeline steps (weights loaded from ``folder``),
    each dp rank on its rows of the global batches; losses averaged over dp."""
    torch.manual_seed(0)
    plugin = HybridParallelPlugin(**kwargs)
    booster = Booster(plugin=plugin)
    model = _build(family, name)
    optim = _optimizer(model)
    model, optim, *_ = booster.boost(model, optim)
    if folder is not None:
        booster.load_pretrained(model, folder)
    dp, losses = plugin.dp_size(), []
    for batch in batches(family):
        batch = _rows(batch, plugin.dp_rank(), dp)
        step = booster.execute_pipeline((_x(batch), batch["labels"]), model, CRITERIA[family], optim)
        if dp > 1:
            torch.distributed.all_reduce(step, group=plugin.dp_group)
        losses.append(step.item() / dp)
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
        ("mixtral", "mixtral", dict(tp_size=1, pp_size=2)),  # with its router aux loss
        ("mixtral-sp", "mixtral", dict(tp_size=1, sp_size=2)),  # with its router aux loss
        ("sp", "llama", dict(tp_size=1, sp_size=2, pp_size=2)),
    ):
        torch.manual_seed(0)
        if name == "layers":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64))
        elif family == "mixtral":
            model = build(family)
            model.config.output_router_logits = True
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


def _fresh_meta() -> dict:
    """A meta-device BERT under pp2 x tp2, not loaded: this rank's stages hold ``transformers``'
    own initial values (norms 1, biases 0, weights of std ``initializer_range``, the non-persistent
    ``position_ids`` buffer 0..T-1), and it trains to finite losses."""
    torch.manual_seed(0)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, **PP))
    with torch.device("meta"):
        model = build("bert")
    model, optim, *_ = booster.boost(model, _optimizer(model))
    hf_model = booster.plugin.unwrap(model.module)
    bert = hf_model.bert
    real = {n: p for n, p in hf_model.named_parameters() if not p.is_meta}
    out = {
        "norms": all(bool((p == 1).all()) for n, p in real.items() if "LayerNorm.weight" in n),
        "biases": all(bool((p == 0).all()) for n, p in real.items() if n.endswith("bias")),
        "std": sorted({round(p.std().item(), 2) for n, p in real.items() if p.dim() == 2}),
        "positions": None if bert.embeddings.position_ids.is_meta else bert.embeddings.position_ids.tolist(),
    }
    batch = batches("bert")[0]
    out["loss"] = booster.execute_pipeline((_x(batch), batch["labels"]), model, masked_lm_loss, optim).item()
    return out


def _all_cases(world: int, root: str) -> dict:
    out = {"fresh-meta": _fresh_meta()} if world == 4 else {}
    for (family, name), kwargs in CASES[world].items():
        try:
            folder = pathlib.Path(root) / f"src-{family}" if "meta" in name else None
            booster, model, losses = _pipeline(kwargs, family, folder, name)
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
    for family in ("gpt2", "llama"):  # folders written by transformers itself, before the ranks start
        torch.manual_seed(0)
        build(family).save_pretrained(tmp_path / f"src-{family}", max_shard_size="8KB")
    results = run_distributed(_all_cases, world, world, str(tmp_path), timeout=240)
    refs = {}
    for family, name in CASES[world]:
        kind = "meta" if "meta" in name else "4 layers" if "4 layers" in name else ""
        if (family, kind) not in refs:
            folder = tmp_path / f"src-{family}" if kind == "meta" else None
            ref_losses, dense = _dense(family, folder, kind)
            refs[family, kind] = torch.tensor(ref_losses), {k: v.detach() for k, v in dense.state_dict().items()}
    failures = []
    for rank, got in enumerate(results):
        if world == 4:
            _check_fresh_meta(rank, got.pop("fresh-meta"), failures)
        for (family, name), value in ((k, v) for k, v in got.items() if k != "errors" and k[1] != "round-trip"):
            if isinstance(value, str):
                failures.append(f"rank {rank} {family} {name}: {value}")
                continue
            losses, state = value
            ref = refs[family, "meta" if "meta" in name else "4 layers" if "4 layers" in name else ""]
            _close(torch.tensor(losses), ref[0], f"rank {rank} {family} {name} losses", failures)
            ref_state = ref[1]
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
        "mixtral": "NotImplementedError: mixtral: pipeline parallelism (pp_size=2) with config.output_router_logits",
        "mixtral-sp": "NotImplementedError: mixtral: sequence parallelism (sp_size=2) with config.output_router_logits",
        "sp": "NotImplementedError: llama: pipeline x sequence parallelism",
        "key": "ValueError: pipeline inputs ['token_type_ids'] are not supported",
        "shape": "ValueError: ['attention_mask'] must have the shape of input_ids (8, 8)",
    }
    for name, start in expect.items():
        if not errors[name].startswith(start):
            failures.append(f"rank {rank} error {name}: {errors[name]!r} does not start with {start!r}")


def _check_fresh_meta(rank: int, got: dict, failures: list) -> None:
    first_stage = rank < 2  # pp outermost: ranks 0, 1 hold the embeddings
    want = {"norms": True, "biases": True, "std": [0.02]}
    want["positions"] = [list(range(32))] if first_stage else None
    bad = {k: got[k] for k, v in want.items() if got[k] != v}
    if bad or not math.isfinite(got["loss"]):
        failures.append(f"rank {rank} fresh meta BERT: {bad}, loss {got['loss']}")
