"""``colossalai finetune`` end to end: a base trained by ``colossalai train``, fine-tuned with LoRA
on a corpus of the user's (2 processes, Gemini and ZeRO-3), the adapter read back by plain ``peft``
and the merged folder compared with ``peft``'s own merge; resume; bad options.

The base's weights are checked to have reached the fine-tuning run through the outputs alone: the
merged folder must equal (base weights of the ``--export`` folder) + (the adapter, as ``peft``
merges it), which fails if the run had trained its adapter on any other base.
"""

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")

from test_colossalai_cli import TRAIN, _cli, _losses  # noqa: E402
from test_colossalai_tokenizer import sentencepiece_like  # noqa: E402

from colossalai.data import CorpusTokenizer  # noqa: E402
from colossalai.models import model_family  # noqa: E402

CORPUS = "def greet(name):\n    return 'hello ' + name\n\n" * 300
FINETUNE = ["finetune", "--batch-size", "8", "--progress", "plain", "--log-every", "1", "--sample-tokens", "8"]
FINETUNE += ["--warmup", "1", "--lr", "1e-2", "--lora-rank", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "200")  # rich's summary table on one line per row
        return _runs(tmp_path_factory.mktemp("finetune"))


def _runs(root):
    (root / "corpus").mkdir()
    (root / "corpus" / "greet.py").write_text(CORPUS)
    (root / "corpus" / "blob.bin").write_bytes(bytes(range(256)) * 4)  # not text: left out
    _cli(*TRAIN, "--steps", "4", "--save-dir", str(root / "base"), "--export", str(root / "exp"))
    hf_gpt2().save_pretrained(root / "hf")  # a Hugging Face folder with a byte-level BPE tokenizer.json
    CorpusTokenizer.train(CORPUS.encode(), 300).save_hf(root / "hf")
    hf_out = ["--adapter-out", str(root / "ad-hf"), "--merge-out", str(root / "merged-hf")]
    out = {"hf": _cli(*FINETUNE, "--plugin", "ddp", "--base", str(root / "hf"), "--corpus", str(root / "corpus"),
                      "--steps", "3", *hf_out)}  # fmt: skip
    hf_llama().save_pretrained(root / "llama")  # a SentencePiece-style tokenizer.json (Llama 2's kind)
    (root / "llama" / "tokenizer.json").write_text(sentencepiece_like(CORPUS, 320), encoding="utf-8")
    llama_out = ["--adapter-out", str(root / "ad-llama"), "--merge-out", str(root / "merged-llama")]
    # one process: Llama under tp2 is in test_booster_lora_hybrid.py, the CLI's hybrid path below
    out["llama"] = _cli(*FINETUNE, "--plugin", "ddp", "--base", str(root / "llama"), "--corpus", str(root / "corpus"),
                        "--steps", "2", *llama_out)  # fmt: skip
    plugins = {"gemini": ["--plugin", "gemini", "--device-budget", "3MiB"], "zero3": ["--plugin", "zero",
               "--zero-stage", "3"], "hybrid": ["--plugin", "hybrid", "--tp-size", "2"]}  # fmt: skip
    for name, plugin in plugins.items():
        src = root / ("base" if name == "gemini" else "exp")  # a checkpoint, an export folder
        out[name] = _cli(*FINETUNE, *plugin, "--nproc", "2", "--base", str(src), "--corpus", str(root / "corpus"),
                         "--steps", "3", "--adapter-out", str(root / f"ad-{name}"), "--merge-out",
                         str(root / f"merged-{name}"), "--save-dir", str(root / f"ft-{name}"))  # fmt: skip
    return root, out


def hf_gpt2():
    import transformers

    torch.manual_seed(2)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def hf_llama():
    import transformers

    torch.manual_seed(3)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=32,
                                      use_cache=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_llama_folder_with_a_sentencepiece_tokenizer_fine_tunes(runs):
    """Llama 2's kind of tokenizer.json (byte fallback, word markers) encodes the corpus; the adapter
    and the merged folder load in peft / transformers alike."""
    import transformers

    root, out = runs
    assert "hf:BPE, 320 ids" in out["llama"] and "Hugging Face llama" in out["llama"]
    assert "on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in out["llama"]
    lora = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(root / "llama"), root / "ad-llama"
    )
    merged = transformers.LlamaForCausalLM.from_pretrained(root / "merged-llama")
    x = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged(x).logits, lora(x).logits, rtol=1e-5, atol=1e-5)
    assert (root / "merged-llama" / "tokenizer.json").read_text() == (root / "llama" / "tokenizer.json").read_text()


def test_a_hugging_face_folder_fine_tunes_and_merges_as_peft_merges(runs):
    import transformers

    root, out = runs
    assert "Hugging Face gpt2" in out["hf"] and "on c_attn, c_fc, c_proj" in out["hf"]  # every linear layer
    base = transformers.GPT2LMHeadModel.from_pretrained(root / "hf")
    lora = peft.PeftModel.from_pretrained(base, root / "ad-hf")
    assert all(p.abs().sum() > 0 for n, p in lora.named_parameters() if "lora_B" in n)
    merged = transformers.GPT2LMHeadModel.from_pretrained(root / "merged-hf")
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged(x).logits, lora(x).logits, rtol=1e-5, atol=1e-5)
    assert (root / "merged-hf" / "tokenizer.json").is_file() and (root / "merged-hf" / "config.json").is_file()


def _gpt_tiny():
    family = model_family("gpt")
    return family.build("tiny", seed=0, block_size=32, vocab_size=1024, activation_checkpointing=False)


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name", ["gemini", "zero3", "hybrid"])
def test_finetune_summary_names_the_adapter_and_the_frozen_base(runs, name):
    _, out = runs
    assert "colossalai finetune" in out[name]
    assert "r=4, alpha 8 on fc_in, fc_out, k_proj, out_proj, q_proj, v_proj" in out[name]
    assert "trainable" in out[name] and "frozen base" in out[name] and "per process" in out[name]
    assert len(_losses(out[name])) == 3
    if name == "gemini":  # the frozen base is placed by Gemini: its tiers are named
        assert "model states" in out[name] and "x the device budget" in out[name]


@pytest.mark.parametrize("name", ["gemini", "zero3", "hybrid"])
def test_adapter_loads_in_plain_peft_and_merge_is_peft_merge(runs, name):
    root, _ = runs
    base = _gpt_tiny()
    base.load_state_dict(load_file(root / "exp" / "model-00001-of-00001.safetensors"))  # the trained base
    lora = peft.PeftModel.from_pretrained(base, root / f"ad-{name}")
    b = [p for n, p in lora.named_parameters() if "lora_B" in n]
    assert b and all(p.abs().sum() > 0 for p in b)  # trained (lora_B starts at zero)
    x = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    want = _logits(lora, x)
    merged = _gpt_tiny()
    result = merged.load_state_dict(load_file(root / f"merged-{name}" / "model.safetensors"), strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to wte, saved once
    torch.testing.assert_close(_logits(merged, x), want, rtol=1e-5, atol=1e-5)
    reference = lora.merge_and_unload().state_dict()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, reference[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_finetune_resumes_and_its_merge_is_a_base(runs, monkeypatch):
    root, _ = runs
    monkeypatch.setenv("COLUMNS", "200")
    out = _cli(*FINETUNE, "--plugin", "ddp", "--base", str(root / "base"), "--corpus", str(root / "corpus"),
               "--steps", "4", "--resume", str(root / "ft-gemini"))  # fmt: skip
    assert sorted(_losses(out)) == [4] and "3 -> 4" in out
    out = _cli(*FINETUNE, "--plugin", "ddp", "--base", str(root / "merged-zero3"), "--steps", "1")
    assert "merged-zero3 (folder)" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--base", "{root}/corpus"], "is neither a colossalai train checkpoint"),
        (["--base", "{root}/exp", "--seq-len", "64"], "--seq-len 64 exceeds the 32 positions"),
        (["--base", "{root}/exp", "--plugin", "hybrid", "--tp-size", "4", "--tp-mode", "2d"], "got --tp-mode 2d"),
        (["--base", "{root}/exp", "--export", "{root}/x"], "--export writes a train run's model"),
        (["--base", "{root}/exp", "--lora-rank", "0"], "--lora-rank must be >= 1, got 0"),
        (["--base", "{root}/exp", "--corpus", "{root}/nothing"], "--corpus {root}/nothing: no such file"),
    ],
)
def test_bad_finetune_options_are_one_line(runs, capsys, extra, message):
    from colossalai.cli.main import main

    root, _ = runs
    assert main(["finetune", *(e.format(root=root) for e in extra)]) == 2
    assert message.format(root=root) in capsys.readouterr().err


def test_targets_that_match_nothing_are_named(runs, capsys):
    from colossalai.cli.main import main

    root, _ = runs
    assert main(["finetune", "--base", str(root / "exp"), "--plugin", "ddp", "--lora-targets", "qq"]) == 2
    assert "target_modules=['qq'] match no module of GPT" in capsys.readouterr().err
