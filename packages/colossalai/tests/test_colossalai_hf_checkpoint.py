"""Hugging Face ``save_pretrained`` folders in and out of a boosted model.

A tiny random GPT-2 (and Llama, and a BERT decoder under Gemini) is saved locally with
``transformers``' own ``save_pretrained`` (sharded with an index, or one ``model.safetensors``),
loaded by ``Booster.load_pretrained`` under each plugin, trained 3 steps, exported with
``Booster.save_pretrained`` and read back with ``AutoModelForCausalLM.from_pretrained`` strictly
(``output_loading_info``: nothing missing or unexpected). Logits are compared in fp32 with rtol 1e-5
(the same weights and the same forward; only the reduction order of a sharded forward may differ).
"""

import pathlib

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hf_models import logits_of  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import Booster  # noqa: E402
from colossalai.booster.registry import make_plugin  # noqa: E402
from colossalai.checkpoint import CheckpointMismatchError, SafetensorsReader  # noqa: E402
from colossalai.checkpoint import hf as hf_io  # noqa: E402

VOCAB = 96


def gpt2_config(**kw):
    base = dict(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2Config(**(base | kw))


def llama_config():
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def bert_config():
    """A BERT decoder (``BertLMHeadModel``): ``cls.predictions.bias`` is tied to ``cls.predictions.decoder.bias``,
    a parameter its parent and its child module both use in one forward."""
    return transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True,
    )  # fmt: skip


def saved_folder(root, config, *, seed: int = 0, shard: str | None = "8KB") -> pathlib.Path:
    """A random model saved by ``transformers`` itself (sharded with an index when ``shard``)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    folder = pathlib.Path(root) / f"src-{config.model_type}-{seed}-{shard}"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def tokens(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder, x):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    strict = {k: sorted(v) for k, v in info.items() if k != "error_msgs"} | {"error_msgs": info["error_msgs"]}
    return logits_of(model, x), strict


LLAMA_TP_PLAN = {  # a user's plan (Megatron 1D): q/k/v, gate/up split by columns, o/down by rows
    "model.layers.*.self_attn.q_proj": "col",
    "model.layers.*.self_attn.k_proj": "col",
    "model.layers.*.self_attn.v_proj": "col",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "col",
    "model.layers.*.mlp.up_proj": "col",
    "model.layers.*.mlp.down_proj": "row",
}


def _plugin(spec: str):
    kwargs = {"zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3}}.get(spec, {})
    if spec == "hybrid-tp2-plan":  # a user plan (no built-in policy needed)
        return make_plugin("hybrid", tp_size=2, plan=LLAMA_TP_PLAN)
    if spec.startswith("hybrid"):  # "hybrid-tp2": the built-in policy of the family
        return make_plugin("hybrid", tp_size=int(spec.rsplit("tp", 1)[1]))
    return make_plugin("zero" if spec.startswith("zero") else spec, **kwargs)


class _Recording(SafetensorsReader):
    """Counts what the (last) reader read on this rank; small pieces, as the model is tiny."""

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, piece_numel=256, **kwargs)
        type(self).last = self


def load_train_export(spec: str, src: str, out: str, model_type: str, steps: int = 3) -> dict:
    """Boost a fresh model, load ``src``, train ``steps`` steps, export to ``out``; per rank."""
    config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(123)  # weights that differ from the folder's
    model = transformers.AutoModelForCausalLM.from_config(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=_plugin(spec))
    model, optim, *_ = booster.boost(model, optim)
    hf_io.SafetensorsReader, original = _Recording, hf_io.SafetensorsReader
    try:
        skipped = booster.load_pretrained(model, src)
    finally:
        hf_io.SafetensorsReader = original
    x = tokens()
    result = {"skipped": skipped, "loaded": logits_of(model, x), "read": _Recording.last.read_numel}
    for step in range(steps):
        batch = tokens(seed=10 + step)
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
        booster.backward(loss, optim)
        optim.step()
        optim.zero_grad()
    result["trained"] = logits_of(model, x)
    booster.save_pretrained(model, out, max_shard_size="8KB")
    return result


def _numel(folder) -> int:
    reader = SafetensorsReader(folder)
    return sum(reader.held().values())


# ---- one process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard", ["8KB", None], ids=["sharded-index", "single-file"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_load_train_export_round_trip_single_process(tmp_path, shard, family):
    config = gpt2_config() if family == "gpt2" else llama_config()
    src = saved_folder(tmp_path, config, shard=shard)
    assert (src / hf_io.INDEX_NAME).is_file() == (shard is not None)
    want, info = hf_logits(src, tokens())
    out = tmp_path / "out"
    result = load_train_export("ddp", str(src), str(out), family)
    torch.testing.assert_close(result["loaded"], want, rtol=1e-5, atol=1e-6)
    assert not result["skipped"]
    got, info = hf_logits(out, tokens())
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    torch.testing.assert_close(got, result["trained"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(result["trained"], result["loaded"])  # the 3 steps changed the model
    assert (out / hf_io.INDEX_NAME).is_file() and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "config.json").is_file()


def test_small_export_is_one_file_without_index(tmp_path):
    src = saved_folder(tmp_path, gpt2_config())
    booster = Booster(plugin=_plugin("ddp"))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(gpt2_config()))
    booster.load_pretrained(model, src)
    booster.save_pretrained(model, tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    got, info = hf_logits(tmp_path / "one", tokens())
    assert not any(info.values())
    torch.testing.assert_close(got, logits_of(model, tokens()), rtol=1e-5, atol=1e-6)


def test_untied_head_and_base_model_folder(tmp_path):
    """An untied lm_head is its own tensor; a base model's folder loads into a model with a head
    (prefix added, as from_pretrained does) and then reports the head as missing."""
    config = gpt2_config(tie_word_embeddings=False)
    src = saved_folder(tmp_path, config)
    booster = Booster(plugin=_plugin("ddp"))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(config))
    booster.load_pretrained(model, src)
    torch.testing.assert_close(logits_of(model, tokens()), hf_logits(src, tokens())[0], rtol=1e-5, atol=1e-6)

    torch.manual_seed(5)
    base = transformers.GPT2Model(gpt2_config())
    base.save_pretrained(tmp_path / "base")
    booster = Booster(plugin=_plugin("ddp"))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(gpt2_config()))
    booster.load_pretrained(model, tmp_path / "base")  # tied head: nothing missing
    torch.testing.assert_close(model.module.transformer.wte.weight, base.wte.weight)
    booster = Booster(plugin=_plugin("ddp"))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(CheckpointMismatchError, match="1 missing: model/lm_head.weight"):
        booster.load_pretrained(model, tmp_path / "base")


def test_strict_lists_every_missing_unexpected_and_misshaped_tensor(tmp_path):
    src = saved_folder(tmp_path, gpt2_config(n_layer=3))  # one block too many
    config = gpt2_config(n_layer=2, n_positions=16)  # and a shorter position table
    booster = Booster(plugin=_plugin("ddp"))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(config))
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        booster.load_pretrained(model, src)
    entries = err.value.entries
    assert entries.missing == []
    # what from_pretrained lists: block 2 less c_attn.bias, which GPT-2's
    # _keys_to_ignore_on_load_unexpected pattern "attn.bias" also matches (checked against transformers)
    _, info = transformers.GPT2LMHeadModel.from_pretrained(src, n_layer=2, output_loading_info=True)
    assert len(info["unexpected_keys"]) == 11
    assert entries.unexpected == sorted(f"model/{k}" for k in info["unexpected_keys"])
    assert entries.mismatched == ["model/transformer.wpe.weight: checkpoint (32, 32) float32, model (16, 32) float32"]
    assert all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())  # nothing changed

    config = gpt2_config(n_layer=3, n_positions=32)
    small = saved_folder(tmp_path, gpt2_config(n_layer=2))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(CheckpointMismatchError, match="12 missing"):
        booster.load_pretrained(model, small)
    skipped = booster.load_pretrained(model, small, strict=False)
    assert len(skipped.missing) == 12 and not skipped.unexpected


def test_bad_folder_and_shard_size_raise(tmp_path):
    booster = Booster(plugin=_plugin("ddp"))
    model, *_ = booster.boost(transformers.AutoModelForCausalLM.from_config(gpt2_config()))
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        booster.load_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match="max_shard_size"):
        booster.save_pretrained(model, tmp_path / "x", max_shard_size="5 parsecs")
    assert hf_io.parse_shard_size("2GiB") == 2 * 2**30 and hf_io.parse_shard_size("500MB") == 500 * 10**6


def test_reader_reads_only_the_rows_asked_for(tmp_path):
    src = saved_folder(tmp_path, gpt2_config(), shard=None)
    reader = SafetensorsReader(src, piece_numel=64)  # wte (96, 32): two rows per piece
    keys = reader.overlapping("model/transformer.wte.weight", 100, 300)  # rows 3..9
    got = reader.read(keys)
    assert sum(t.numel() for t in got.values()) == 4 * 64  # rows 2..9, nothing else
    dense = transformers.AutoModelForCausalLM.from_pretrained(src).transformer.wte.weight.detach()
    torch.testing.assert_close(reader.assemble("model/transformer.wte.weight", 100, 300, got), dense.view(-1)[100:300])
    box = reader.read_box("model/transformer.wte.weight", (slice(0, 96), slice(16, 32)))
    torch.testing.assert_close(box, dense[:, 16:])


# ---- several processes ---------------------------------------------------------------------------------
SHARDED = ["fsdp", "zero1", "zero2", "zero3", "gemini"]


@pytest.mark.parametrize("spec", SHARDED)
def test_each_rank_reads_its_slices_and_gets_the_folder_logits(tmp_path, spec):
    src = saved_folder(tmp_path, gpt2_config(n_embd=64))
    want, _ = hf_logits(src, tokens())
    results = run_distributed(load_train_export, 2, spec, str(src), str(tmp_path / "out"), "gpt2", 0, timeout=120)
    total = _numel(src)
    for r in results:
        torch.testing.assert_close(r["loaded"], want, rtol=1e-5, atol=1e-6)
        if spec != "zero1" and spec != "zero2":  # stages 1-2 hold whole fp32 parameters on every rank
            assert r["read"] < 0.75 * total, (r["read"], total)  # its half plus pieces at the edges


@pytest.mark.parametrize("spec", ["zero3", "gemini"])
def test_folder_boost_train_export_from_pretrained(tmp_path, spec):
    src = saved_folder(tmp_path, gpt2_config())
    _round_trip(src, tmp_path / "out", spec)


def test_bert_folder_gemini_train_export_from_pretrained(tmp_path):
    """BERT's tied prediction bias (parent and child module) under Gemini: load, train, export (#15)."""
    src = saved_folder(tmp_path, bert_config())
    want, _ = hf_logits(src, tokens())
    for r in _round_trip(src, tmp_path / "out", "gemini"):
        torch.testing.assert_close(r["loaded"], want, rtol=1e-5, atol=1e-6)


def test_folder_tp2_user_plan_train_export_from_pretrained(tmp_path):
    """tp=2 over a Hugging Face Llama with a user's plan: each rank reads its half of every split
    weight (o_proj/down_proj by columns: read_box), trains, and the export loads in transformers."""
    src = saved_folder(tmp_path, llama_config())
    want, _ = hf_logits(src, tokens())
    results = _round_trip(src, tmp_path / "out", "hybrid-tp2-plan")
    for r in results:
        torch.testing.assert_close(r["loaded"], want, rtol=1e-5, atol=1e-6)
        assert r["read"] < 0.8 * _numel(src), (r["read"], _numel(src))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_folder_tp2_builtin_policy_train_export_from_pretrained(tmp_path, family):
    """tp=2 with the built-in policy of the family (GPT-2's fused Conv1D projections are permuted
    by its policy, so those ranks read the whole tensors and keep their blocks)."""
    src = saved_folder(tmp_path, gpt2_config() if family == "gpt2" else llama_config())
    want, _ = hf_logits(src, tokens())
    for r in _round_trip(src, tmp_path / "out", "hybrid-tp2"):
        torch.testing.assert_close(r["loaded"], want, rtol=1e-5, atol=1e-6)


def _round_trip(src, out, spec):
    results = run_distributed(load_train_export, 2, spec, str(src), str(out), "", timeout=180)
    got, info = hf_logits(out, tokens())
    assert not any(info.values()), info
    for r in results:
        torch.testing.assert_close(got, r["trained"], rtol=1e-5, atol=1e-6)
    return results
