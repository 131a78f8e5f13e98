"""A base model's checkpoint into a boosted LoRA model, and the adapter merged into a full folder.

The "pretrained" base is the tiny GPT-2 / Llama of ``test_booster_lora`` with other weights (seed
1); the LoRA model is built from seed 0, boosted on 2 ranks, then gets the pretrained weights from
a Hugging Face folder (``load_pretrained``) or a sharded checkpoint of a run without LoRA
(``load_model``) and an adapter from plain ``peft`` (``load_lora``). Its logits must equal plain
``peft``'s on the pretrained model in one process (fp32, 1e-5: the same computation, sharded).
``save_merged_as_pretrained`` must write what ``peft``'s ``merge_and_unload`` gives.
"""

import pytest
import safetensors
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_booster_lora import base_model, batch, logits_of, lora_config  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import Booster, GeminiPlugin, TorchDDPPlugin, ZeroPlugin  # noqa: E402
from colossalai.checkpoint import CheckpointMismatchError  # noqa: E402

PLUGINS = {
    "zero3": lambda: ZeroPlugin(stage=3),
    "gemini": lambda: GeminiPlugin(placement="auto"),
    "ddp": lambda: TorchDDPPlugin(),
}


def pretrained(family: str):
    """The base with other weights than ``base_model``'s (what a user fine-tunes)."""
    model = base_model(family)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _boosted(plugin_name: str, family: str, **kw):
    booster = Booster(plugin=PLUGINS[plugin_name]())
    model = booster.enable_lora(base_model(family), lora_config(family, **kw))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optim, *_ = booster.boost(model, optim)
    return booster, model


def _runs(root):
    out, x = {}, batch(0)
    # A sharded checkpoint of the pretrained GPT-2 written by a run without LoRA (ZeRO-2, 2 ranks).
    booster = Booster(plugin=ZeroPlugin(stage=2))
    plain = pretrained("gpt2")
    plain, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters()))
    booster.save_model(plain, root, "base-dcp")
    for name in PLUGINS:
        booster, model = _boosted(name, "gpt2")
        out[f"{name}-hf-found"] = booster.load_pretrained(model, root / "hf-gpt2")
        booster.load_lora(model, root / "adapter-gpt2")
        out[f"{name}-hf"] = logits_of(model, x)
        booster.save_merged_as_pretrained(model, root / f"merged-{name}")
        booster, model = _boosted(name, "gpt2")
        booster.load_model(model, root / "base-dcp")
        booster.load_lora(model, root / "adapter-gpt2")
        out[f"{name}-dcp"] = logits_of(model, x)
    # An embedding as a LoRA target: peft saves its base weight with the adapter, both ways.
    booster = Booster(plugin=ZeroPlugin(stage=3))
    model = booster.enable_lora(pretrained("llama"), emb_config())
    model, *_ = booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    out["emb-found"] = booster.load_lora(model, root / "adapter-emb")  # strict: the embedding is expected
    out["emb"] = logits_of(model, x)
    booster.save_lora_as_pretrained(model, root / "saved-emb")
    # modules_to_save: the trained copy of lm_head is filled from the base's lm_head too.
    booster, model = _boosted("zero3", "llama", modules_to_save=["lm_head"])
    booster.load_pretrained(model, root / "hf-llama")
    out["llama-modules-to-save"] = logits_of(model, x)
    try:  # a folder of another model: every mis-shaped base tensor under the folder's own names
        booster.load_pretrained(model, root / "hf-wrong")
    except CheckpointMismatchError as e:
        out["wrong"] = str(e)
    out["after-wrong"] = logits_of(model, x)
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-base")
    pretrained("gpt2").save_pretrained(root / "hf-gpt2")
    pretrained("llama").save_pretrained(root / "hf-llama")
    cfg = base_model("llama").config
    cfg.intermediate_size = 48
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "hf-wrong")
    ref = peft.get_peft_model(pretrained("gpt2"), lora_config("gpt2", init_lora_weights=False))
    ref.save_pretrained(root / "adapter-gpt2")
    emb = peft.get_peft_model(pretrained("llama"), emb_config())
    emb.save_pretrained(root / "adapter-emb")  # with save_embedding_layers="auto": the embedding too
    out = run_distributed(_runs, 2, root, timeout=240)[0]
    return root, out, ref


def emb_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)


def test_an_adapted_embedding_travels_with_the_adapter_as_peft_saves_it(results):
    root, out, _ = results
    keys = [sorted(safetensors.safe_open(str(root / f / "adapter_model.safetensors"), "pt").keys())
            for f in ("adapter-emb", "saved-emb")]  # fmt: skip
    assert "base_model.model.model.embed_tokens.base_layer.weight" in keys[0]
    assert keys[0] == keys[1]  # the Booster writes what plain peft writes
    assert not out["emb-found"]
    plain = peft.PeftModel.from_pretrained(pretrained("llama"), root / "adapter-emb")
    torch.testing.assert_close(out["emb"], logits_of(plain, batch(0)), rtol=1e-5, atol=1e-6)
    damaged = pretrained("llama")
    damaged.model.embed_tokens.weight.data.zero_()
    again = peft.PeftModel.from_pretrained(damaged, root / "saved-emb")  # the embedding comes along
    torch.testing.assert_close(logits_of(again, batch(0)), out["emb"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plugin_name", list(PLUGINS))
@pytest.mark.parametrize("source", ["hf", "dcp"])
def test_base_checkpoint_loads_into_a_lora_model(results, plugin_name, source):
    _, out, ref = results
    torch.testing.assert_close(out[f"{plugin_name}-{source}"], logits_of(ref, batch(0)), rtol=1e-5, atol=1e-6)
    if source == "hf":
        assert not out[f"{plugin_name}-hf-found"]  # nothing missing: the adapter is not the base's


@pytest.mark.parametrize("plugin_name", list(PLUGINS))
def test_merged_folder_is_what_peft_merges(results, plugin_name):
    root, _, ref = results
    merged = transformers.GPT2LMHeadModel.from_pretrained(root / f"merged-{plugin_name}")
    expected = peft.PeftModel.from_pretrained(pretrained("gpt2"), root / "adapter-gpt2").merge_and_unload()
    state, want = merged.state_dict(), expected.state_dict()
    assert set(state) == set(want)
    for k in want:
        torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(logits_of(merged, batch(0)), logits_of(ref, batch(0)), rtol=1e-5, atol=1e-5)


def test_modules_to_save_copy_is_filled_from_the_base(results):
    _, out, _ = results
    ref = peft.get_peft_model(pretrained("llama"), lora_config("llama", modules_to_save=["lm_head"]))
    torch.testing.assert_close(out["llama-modules-to-save"], logits_of(ref, batch(0)), rtol=1e-5, atol=1e-6)


def test_wrong_base_folder_names_its_own_tensors(results):
    _, out, _ = results
    assert "model/model.layers.0.mlp.up_proj.weight: checkpoint (48, 32) float32, model (64, 32)" in out["wrong"]
    assert "base_model.model" not in out["wrong"]  # the folder's names, not the PeftModel's
    torch.testing.assert_close(out["after-wrong"], out["llama-modules-to-save"])  # nothing changed
