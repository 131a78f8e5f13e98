"""LoRA through the Booster (``enable_lora``, ``save_lora_as_pretrained``, ``load_lora``) against
plain single-process ``peft``.

A tiny GPT-2 (LoRA r=4 on ``c_attn``, a ``Conv1D``: ``fan_in_fan_out=True``) and a tiny Llama
(LoRA on ``q_proj``, ``v_proj``) train 3 AdamW steps under each plugin on 2 ranks (gloo, fp32),
each rank a batch of the same size without ``-100`` labels, so the mean of the ranks' losses is
the loss of the reference over the two batches together. Per-step losses and the adapter weights
after 3 steps match the reference to 1e-5 relative: the same fp32 computation, only the order of
the summations differs (the gradient all-reduce / reduce-scatter over ranks, a sharded forward);
the adapter weights also get an absolute tolerance of ``1e-3 * lr`` (the note below). The frozen
base weights are bitwise unchanged. Adapter folders go both ways between the Booster (ZeRO-3, DDP)
and plain ``peft`` (``PeftModel.from_pretrained`` / ``save_pretrained``), compared by logits to 1e-5.

[Note: Adam and a near-cancelling gradient]
Adam moves each element by ``lr * m / (sqrt(v) + eps)``: the gradient divided by its own size.
An element whose gradient is a sum that nearly cancels (GPT-2's layer-1 ``lora_A`` has one of
4.85e-8 at step 2, where the largest is 2e-3) keeps only a few correct digits in fp32, and its
update, ``lr * g / (|g| + eps)`` with ``eps = 1e-8``, moves with them: splitting the batch in two
backward passes in one process (what data parallelism sums) gives 4.83e-8 and a weight 5.7e-6
(5.7e-4 * lr) away. That is summation order, not a bug, so the weights are compared to
``rtol=1e-5`` plus ``atol=1e-3 * lr``; the losses (the end-to-end check) to ``rtol=1e-5`` alone.
"""

import pytest
import safetensors
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import hf_models  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import (  # noqa: E402
    Booster,
    GeminiPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
    ZeroPlugin,
)
from colossalai.checkpoint import CheckpointMismatchError  # noqa: E402

STEPS, B, T, V = 3, 2, 8, 64  # B: rows per rank
LR = 1e-2
WEIGHT_ATOL = 1e-3 * LR  # [Note: Adam and a near-cancelling gradient]
FAMILIES = ("gpt2", "llama")
PLUGINS = {
    "ddp": lambda: TorchDDPPlugin(),
    "zero1": lambda: ZeroPlugin(stage=1),
    "zero2": lambda: ZeroPlugin(stage=2),
    "zero3": lambda: ZeroPlugin(stage=3),
    "zero3-offload": lambda: ZeroPlugin(stage=3, offload=True),
    "fsdp": lambda: TorchFSDPPlugin(),
    "gemini-static": lambda: GeminiPlugin(placement="static"),
    "gemini-auto": lambda: GeminiPlugin(placement="auto"),
}


def base_model(family: str):
    """The seeded tiny model of ``family`` (``hf_models.build``: no dropout)."""
    torch.manual_seed(0)
    return hf_models.build(family)


def lora_config(family: str, r: int = 4, **kw):
    if family == "gpt2":
        return peft.LoraConfig(r=r, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, **kw)
    return peft.LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kw)


def batch(step: int, rank: int | None = None) -> torch.Tensor:
    """Step ``step``'s tokens: rank ``rank``'s ``(B, T)`` rows, or both ranks' ``(2B, T)`` (None)."""
    ids = torch.randint(0, V, (2 * B, T), generator=torch.Generator().manual_seed(100 + step))
    return ids if rank is None else ids[rank * B : (rank + 1) * B]


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=x).logits.float().cpu()
    model.train()
    return out


def is_adapter(name: str) -> bool:
    return "lora_" in name


# ---- training parity ---------------------------------------------------------------------------
def reference(family: str):
    """Plain peft in one process: per-step losses, the state after 3 steps, the state before."""
    model = peft.get_peft_model(base_model(family), lora_config(family))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), before


def boosted_run(family: str, plugin_name: str):
    """3 steps under the Booster: per-step losses (mean over ranks) and the gathered state."""
    booster = Booster(plugin=PLUGINS[plugin_name]())
    model = booster.enable_lora(base_model(family), lora_config(family))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optim, *_ = booster.boost(model, optim)
    losses = []
    for step in range(STEPS):
        ids = batch(step, dist.get_rank()).to(booster.plugin.device)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optim)
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    full = booster.plugin.full_model_state_dict(model.module)  # gathers (FSDP too): every rank
    state = {k: v.detach().cpu().clone() for k, v in full.items()}
    return losses, state if dist.get_rank() == 0 else None


def _all_runs(cases):
    return {(family, plugin_name): boosted_run(family, plugin_name) for family, plugin_name in cases}


CASES = [(f, p) for p in PLUGINS for f in FAMILIES]


@pytest.fixture(scope="module")
def boosted_results():
    return run_distributed(_all_runs, 2, CASES, timeout=240)[0]


@pytest.mark.parametrize(("family", "plugin_name"), CASES)
def test_lora_training_matches_plain_peft(boosted_results, family, plugin_name):
    losses, state = boosted_results[family, plugin_name]
    ref_losses, ref_state, before = reference(family)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert set(state) == set(ref_state)
    adapters = [k for k in ref_state if is_adapter(k)]
    assert adapters
    for k in adapters:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
        assert not torch.equal(state[k], before[k]) or "lora_A" in k  # trained (lora_B starts at zero)
    changed = [k for k in ref_state if not is_adapter(k) and not torch.equal(state[k], before[k])]
    assert not changed, f"base weights changed: {changed}"


# ---- bf16 mixed precision ------------------------------------------------------------------------
BF16_PLUGINS = ("ddp", "zero3", "fsdp", "gemini-auto")


def _bf16_runs():
    out = {}
    for family in FAMILIES:
        for name in BF16_PLUGINS:
            booster = Booster(plugin=PLUGINS[name](), mixed_precision="bf16")
            model = booster.enable_lora(base_model(family), lora_config(family))
            optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
            model, optim, *_ = booster.boost(model, optim)
            losses = []
            for step in range(STEPS):
                ids = batch(step, dist.get_rank())
                loss = model(input_ids=ids, labels=ids).loss
                booster.backward(loss, optim)
                optim.step()
                optim.zero_grad()
                mean = loss.detach().float().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / dist.get_world_size())
            out[family, name] = losses
    return out


@pytest.fixture(scope="module")
def bf16_results():
    return run_distributed(_bf16_runs, 2, timeout=240)[0]


@pytest.mark.parametrize("plugin_name", BF16_PLUGINS)
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_under_bf16_matches_plain_peft_under_autocast(bf16_results, family, plugin_name):
    """bf16 mixed precision: the engines hold the weights in bf16 (the frozen base with no fp32
    copy, the adapter with an fp32 master), plain peft runs fp32 weights under ``torch.autocast``
    (bf16 matmuls). The two round the same products to bf16 but not always at the same places (the
    engines' norms and softmax inputs are bf16 tensors, autocast keeps some of them fp32), so the
    losses agree to 1e-3 relative (measured: within 1e-4), not to fp32's 1e-5."""
    model = peft.get_peft_model(base_model(family), lora_config(family))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref = []
    for step in range(STEPS):
        ids = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(bf16_results[family, plugin_name]), torch.tensor(ref), rtol=1e-3, atol=0)


# ---- adapter folders in and out ------------------------------------------------------------------
def peft_folder(root, family: str, r: int = 4):
    """An adapter saved by plain peft (random lora_B, so it changes the logits) and its model."""
    model = peft.get_peft_model(base_model(family), lora_config(family, r=r, init_lora_weights=False))
    folder = root / f"peft-{family}-r{r}"
    model.save_pretrained(folder)
    return folder, model


def _trained(plugin):
    """A GPT-2 with LoRA trained 2 steps under ``plugin``."""
    booster = Booster(plugin=plugin)
    model = booster.enable_lora(base_model("gpt2"), lora_config("gpt2"))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optim, *_ = booster.boost(model, optim)
    for step in range(2):
        ids = batch(step, dist.get_rank())
        booster.backward(model(input_ids=ids, labels=ids).loss, optim)
        optim.step()
        optim.zero_grad()
    return booster, model


def _folders(root, plain, wrong):
    out, x = {}, batch(0)
    # Gemini with its disk tier (frozen base streamed from disk), saved as PEFT: from_pretrained must match.
    disk = root / f"disk{dist.get_rank()}"
    disk.mkdir(exist_ok=True)
    gemini = GeminiPlugin(placement="auto", device_memory_budget=300_000, disk_dir=str(disk),
                          host_memory_budget=320_000, chunk_size=4096)  # fmt: skip
    booster, model = _trained(gemini)
    out["gemini-disk-read"] = gemini.model.stats.disk_bytes_read
    gemini.full_model_state_dict = None  # saving the adapter must not gather the base (rank 0 would hold it)
    booster.save_lora_as_pretrained(model, root / "saved-gemini")
    del gemini.full_model_state_dict
    out["saved-gemini"] = logits_of(model, x)
    # Train under ZeRO-3, save as PEFT: the logits of the boosted model, for from_pretrained to match.
    booster, model = _trained(ZeroPlugin(stage=3))
    booster.plugin.full_model_state_dict = None
    booster.save_lora_as_pretrained(model, root / "saved")
    del booster.plugin.full_model_state_dict
    try:  # a folder of a different rank: every adapter entry mis-shaped, one error, nothing changed
        booster.load_lora(model, wrong)
    except CheckpointMismatchError as e:
        out["wrong"] = (str(e), e.entries)
    out["saved"] = logits_of(model, x)  # after the refused load: from_pretrained of the saved folder matches
    # A plain peft folder into a freshly boosted model (its own adapter differs: lora_B is zero).
    for name, plugin in (("zero3", ZeroPlugin(stage=3)), ("ddp", TorchDDPPlugin()), ("gemini", GeminiPlugin())):
        booster = Booster(plugin=plugin)
        model = booster.enable_lora(base_model("gpt2"), lora_config("gpt2"))
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        model, optim, *_ = booster.boost(model, optim)
        out[f"{name}-missing"] = booster.load_lora(model, plain)
        out[name] = logits_of(model, x)
    return out


@pytest.fixture(scope="module")
def folder_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    plain, plain_model = peft_folder(root, "gpt2")
    wrong, _ = peft_folder(root, "gpt2", r=2)
    out = run_distributed(_folders, 2, root, plain, wrong, timeout=180)[0]
    return root, out, plain_model, plain


def test_saved_adapter_loads_in_plain_peft(folder_results):
    root, out, _, plain = folder_results
    assert sorted(p.name for p in (root / "saved").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    keys = [
        sorted(safetensors.safe_open(str(f / "adapter_model.safetensors"), "pt").keys())
        for f in (root / "saved", plain)
    ]
    assert keys[0] == keys[1]  # PEFT's own names, as plain peft writes them
    assert out["gemini-disk-read"] > 0  # the Gemini run really streamed chunks from disk
    for name in ("saved", "saved-gemini"):
        model = peft.PeftModel.from_pretrained(base_model("gpt2"), root / name)
        torch.testing.assert_close(logits_of(model, batch(0)), out[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plugin_name", ["zero3", "ddp", "gemini"])
def test_plain_peft_adapter_loads_under_the_booster(folder_results, plugin_name):
    _, out, plain_model, _ = folder_results
    assert not out[f"{plugin_name}-missing"]  # nothing missing: the base weights are not the adapter's
    torch.testing.assert_close(out[plugin_name], logits_of(plain_model, batch(0)), rtol=1e-5, atol=1e-6)


def test_load_lora_lists_every_mis_shaped_entry(folder_results):
    _, out, _, _ = folder_results
    message, entries = out["wrong"]
    assert len(entries.mismatched) == 4 and not entries.missing and not entries.unexpected  # A and B of 2 layers
    assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight: checkpoint (2, 32)" in message
    assert "model (4, 32)" in message


# ---- bad input, before boost ---------------------------------------------------------------------
def test_targets_that_match_nothing_are_named():
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no module.*transformer\.wte"):
        Booster().enable_lora(base_model("gpt2"), peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_rank_larger_than_the_layer_is_named():
    model = base_model("gpt2")
    with pytest.raises(ValueError, match=r"r=40 .*'.*h\.0\.attn\.c_attn'.*\(32, 96\).*r <= 32"):
        Booster().enable_lora(model, lora_config("gpt2", r=40))
    assert not any("lora_" in n for n, _ in model.named_parameters())  # left as it was


def test_trainable_base_parameters_are_listed():
    model = peft.get_peft_model(base_model("llama"), lora_config("llama"))
    model.get_base_model().model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"1 base parameter.*embed_tokens\.weight.*modules_to_save"):
        Booster().enable_lora(model)
    ok = peft.get_peft_model(base_model("llama"), lora_config("llama", modules_to_save=["lm_head"]))
    assert Booster().enable_lora(ok) is ok  # modules_to_save: trainable and saved with the adapter


def test_lora_config_must_be_a_lora_config():
    with pytest.raises(TypeError, match="peft.LoraConfig, got dict"):
        Booster().enable_lora(base_model("gpt2"), {"r": 4})
    with pytest.raises(TypeError, match="got NoneType"):
        Booster().enable_lora(base_model("gpt2"))
