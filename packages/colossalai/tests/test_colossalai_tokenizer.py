"""The corpus tokenizer (``colossalai.data.CorpusTokenizer``): byte-level BPE learned from the
embedded corpus, exact round trips, determinism (also across processes), checkpoint form, and
the default ``colossalai train`` vocabulary decoding a sample."""

import json
import random
import subprocess
import sys

import pytest
import torch

from colossalai.data import BYTE_VOCAB_SIZE, CorpusTokenizer, corpus_dataset, load_corpus

CORPUS_BYTES = 100_000


@pytest.fixture(scope="module")
def bpe() -> CorpusTokenizer:
    return CorpusTokenizer.train(load_corpus(CORPUS_BYTES), 1024)


def _random_text(rng: random.Random, n: int) -> str:
    """ASCII, whitespace, Latin-1, CJK, emoji and other planes (no lone surrogates: not text)."""
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)) if rng.random() < 0.3 else rng.choice("def self (x):\n    return _"))
    return "".join(out)


@pytest.mark.parametrize("vocab_size", [BYTE_VOCAB_SIZE, 1024])
def test_round_trip_of_random_text(bpe, vocab_size):
    tok = bpe if vocab_size == 1024 else CorpusTokenizer()
    rng = random.Random(vocab_size)
    for n in (0, 1, 7, 300):
        text = _random_text(rng, n)
        ids = tok.encode(text)
        assert ids.dtype == torch.long and all(0 <= i < vocab_size for i in ids.tolist())
        assert tok.decode(ids) == text
    corpus = load_corpus(20_000)
    assert tok.decode(tok.encode_corpus(corpus)) == bytes(corpus.numpy()).decode("utf-8")


def test_bpe_compresses_python_into_keywords_and_identifiers(bpe):
    corpus = load_corpus(CORPUS_BYTES)
    tokens = bpe.encode_corpus(corpus)
    assert tokens.dtype == torch.int32 and corpus.numel() / tokens.numel() > 2.5  # ~3 bytes per token
    for word in ("def", " return", " self", "        ", " import", " None"):
        assert bpe.encode(word).numel() == 1, word


def test_training_is_deterministic_also_in_another_process(bpe):
    assert CorpusTokenizer.train(load_corpus(CORPUS_BYTES), 1024) == bpe
    code = "from colossalai.data import CorpusTokenizer, load_corpus\n"
    code += f"print(CorpusTokenizer.train(load_corpus({CORPUS_BYTES}), 1024).to_json())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert CorpusTokenizer.from_json(other.stdout) == bpe  # Rust's hash maps are seeded per process


def test_saved_form_and_hugging_face_file(bpe, tmp_path):
    again = CorpusTokenizer.from_json(bpe.to_json())
    assert again == bpe and again.vocab_size == 1024 and again.learned == bpe.learned
    assert CorpusTokenizer.from_json(CorpusTokenizer().to_json()) == CorpusTokenizer()
    from tokenizers import Tokenizer

    text = "def f(self, x):\n    return x.items()\n"
    hf = Tokenizer.from_file(str(bpe.save_hf(tmp_path)))
    assert hf.encode(text).ids == bpe.encode(text).tolist()
    assert CorpusTokenizer().save_hf(tmp_path / "bytes") is None
    with pytest.raises(ValueError, match="not a saved CorpusTokenizer"):
        CorpusTokenizer.from_json(json.dumps({"format": "other"}))


def test_decode_keeps_broken_utf8_and_pads(bpe):
    # A sample may stop inside a character: its bytes stay as escapes, never U+FFFD.
    e_acute = CorpusTokenizer().encode("é")
    assert CorpusTokenizer().decode(e_acute[:1]) == "\\xc3"
    small = CorpusTokenizer.train(load_corpus(2_000), 1024)  # too little text for 768 merges
    assert small.learned < small.vocab_size == 1024
    ids = torch.cat([small.encode("def x"), torch.tensor([small.learned, 1023])])  # two padding ids
    assert small.decode(ids) == "def x"
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 1024\), got \[1024\]"):
        bpe.decode(torch.tensor([5, 1024]))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: CorpusTokenizer(255), "vocab_size must be an int >= 256, got 255"),
        (lambda: CorpusTokenizer(512), "needs a learned BPE"),
        (lambda: CorpusTokenizer.train(b"abc", 100), "vocab_size must be an int >= 256, got 100"),
    ],
)
def test_bad_vocab_sizes(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_default_run_vocabulary_decodes_a_sample():
    """``colossalai train``'s defaults: the BPE of the default corpus and a sample of the default
    GPT with that vocabulary, drawn as the CLI does, decode to text."""
    from colossalai.cli.main import build_parser
    from colossalai.models import build_gpt

    args = build_parser().parse_args(["train"])
    tok = CorpusTokenizer.train(load_corpus(args.corpus_bytes), args.vocab_size)
    assert tok.kind == "bpe" and tok.learned == tok.vocab_size == args.vocab_size
    data = corpus_dataset(64, args.corpus_bytes, tok)
    assert int(data.tokens.max()) < args.vocab_size and len(data) * 64 > 1200 * 8 * 64 * 0.9  # ~one pass
    model = build_gpt("mini", seed=0, vocab_size=tok.vocab_size, block_size=64).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = model.generate(tok.encode("def").view(1, -1), 40, temperature=1.0, top_k=None, generator=gen)
    text = tok.decode(out[0])
    assert text.startswith("def") and len(text) > 40 and tok.decode(tok.encode(text)) == text


def sentencepiece_like(text: str, vocab_size: int = 512) -> str:
    """A ``tokenizer.json`` shaped like a converted SentencePiece model (Llama 2, Mistral): BPE over
    ``▁``-marked words with byte fallback (``<0x00>``..``<0xFF>``), ``<unk>``/``<s>``/``</s>``, a
    ``<s>`` added in front by the post-processor, decoded by Replace / ByteFallback / Fuse / Strip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok.to_str()


def test_a_sentencepiece_style_tokenizer_json_encodes_and_decodes_as_tokenizers_does():
    """[Note: any tokenizer.json]: what ``tokenizers`` gives, without the added ``<s>`` (the corpus
    is one stream), and text outside the learned alphabet through the byte-fallback pieces."""
    from tokenizers import Tokenizer

    spec = sentencepiece_like(bytes(load_corpus(20_000).numpy()).decode("utf-8", errors="replace"))
    tok, ref = CorpusTokenizer(1024, spec), Tokenizer.from_str(spec)
    assert tok.kind == "hf:BPE" and tok.learned == ref.get_vocab_size() <= 1024
    text = "def greet(name):\n    return 'héllo ' + name  # ünïcode ✓"
    ids = tok.encode(text)
    assert ids.tolist() == ref.encode(text, add_special_tokens=False).ids
    assert ref.encode(text).ids[0] == 1 and ids[0] != 1  # the post-processor's <s>, left out
    assert any(ref.id_to_token(i).startswith("<0x") for i in ids.tolist())  # byte fallback was used
    assert tok.decode(ids) == text == ref.decode(ids.tolist(), skip_special_tokens=False)
    corpus = torch.tensor(list(text.encode()), dtype=torch.uint8)
    assert tok.encode_corpus(corpus).tolist() == ids.tolist()
    assert tok.decode(torch.cat([ids, torch.tensor([1000])])) == text  # a padding id decodes to nothing
    assert CorpusTokenizer.from_json(tok.to_json()) == tok
    with pytest.raises(ValueError, match="the tokenizer has .* tokens, more than vocab_size 300"):
        CorpusTokenizer(300, spec)


def test_a_byte_level_bpe_with_non_ascii_special_tokens_stays_byte_level(bpe):
    """DeepSeek-style special tokens (``<｜end▁of▁sentence｜>``) are added tokens, not byte-level
    pieces: the vocabulary still decodes through its byte table, the special token as its text."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(json.loads(bpe.to_json())["bpe"])
    special = "<｜end▁of▁sentence｜>"
    hf.add_special_tokens([special])
    tok = CorpusTokenizer(1100, hf.to_str())
    assert tok.kind == "bpe" and tok.learned == bpe.learned + 1
    ids = tok.encode("def f(x):\n    return 'é'" + special)
    assert ids[-1].item() == bpe.learned and tok.decode(ids) == "def f(x):\n    return 'é'" + special
    assert tok.decode(ids[:-1]) == "def f(x):\n    return 'é'"
