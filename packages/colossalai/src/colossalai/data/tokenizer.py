"""The corpus tokenizer: byte-level BPE learned from the embedded corpus, or plain bytes.

[Note: why a learned subword vocabulary]
A byte-level model spends most of a short run learning to spell: after the default run of the
main job (~0.6 M bytes seen) a byte GPT at loss ~1.5 still wrote ``self.__infineg_name_conded``.
Byte-level BPE (Sennrich et al. 2016; GPT-2's byte-to-unicode alphabet, Radford et al. 2019)
learned from the same corpus turns keywords, common identifiers and indentation runs into single
tokens (~3 bytes per token at 1024 ids on the standard library), so the same compute sees three
times more text and a 64-token window spans ~190 bytes. Training it takes well under a second
(Hugging Face ``tokenizers``, Rust) and is deterministic: its merges are chosen by count with ties
broken by the pair's ids, so every rank learns the same vocabulary on its own, and a checkpoint
stores it (``colossalai train`` keeps :meth:`CorpusTokenizer.to_json` in the run state) so that a
resumed run and its sample use the vocabulary the model was trained with.

The model's vocabulary is ``vocab_size`` ids whatever the corpus gives: on a small corpus the
trainer may find fewer merges, and the ids it leaves unused are padding (never a target, decoded as
nothing), so the model's shape, and hence the tensor-parallel split of the vocabulary, depends on
the option only.

[Note: any tokenizer.json]
A Hugging Face base brings its own ``tokenizer.json``: GPT-2's byte-level BPE, or a SentencePiece
model converted to ``tokenizers`` (Llama 2, Mistral: a BPE over ``▁``-marked words with byte
fallback; T5-style Unigram). Any of them encodes through ``tokenizers`` (no special tokens added:
the corpus is one stream of text). A byte-level vocabulary also decodes through its byte table (a
sample cut inside a character keeps its bytes as ``\\xNN``); another one decodes with the
tokenizer's own decoder, which spells byte-fallback pieces and word markers back as text.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from colossalai.data.corpus import VOCAB_SIZE as BYTE_VOCAB_SIZE  # token id == byte value; the BPE alphabet
from colossalai.data.corpus import encode as _encode_bytes

__all__ = ["BYTE_VOCAB_SIZE", "CorpusTokenizer"]

_FORMAT = "colossalai-corpus-tokenizer/1"


def _check_vocab_size(vocab_size) -> None:
    if not isinstance(vocab_size, int) or vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {BYTE_VOCAB_SIZE}, got {vocab_size!r}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of byte-level BPE):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 256 + 256))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


class CorpusTokenizer:
    """Text <-> token ids for the corpus models: bytes (``vocab_size`` 256), a byte-level BPE, or
    any Hugging Face ``tokenizer.json`` (``[Note: any tokenizer.json]``).

    Build one with :meth:`train` (from the corpus bytes) or :meth:`from_json` (from a checkpoint);
    ``decode(encode(text)) == text`` for every string. See ``[Note: why a learned subword
    vocabulary]``.
    """

    def __init__(self, vocab_size: int = BYTE_VOCAB_SIZE, bpe_json: str | None = None) -> None:
        _check_vocab_size(vocab_size)
        if bpe_json is None and vocab_size != BYTE_VOCAB_SIZE:
            raise ValueError(f"a vocab_size of {vocab_size} needs a learned BPE (CorpusTokenizer.train)")
        self.vocab_size = vocab_size
        """Ids the model has (learned tokens plus padding ids; see the module note)."""
        self._bpe = None
        self._bpe_json = bpe_json
        table = [bytes([b]) for b in range(BYTE_VOCAB_SIZE)]
        self._learned = BYTE_VOCAB_SIZE
        if bpe_json is not None:
            from tokenizers import Tokenizer

            self._bpe = Tokenizer.from_str(bpe_json)
            vocab = self._bpe.get_vocab(with_added_tokens=False)  # the model's pieces
            added = {i: t.content for i, t in self._bpe.get_added_tokens_decoder().items()}  # special tokens
            self._learned = max([*vocab.values(), *added], default=-1) + 1
            table = self._byte_table(vocab, added, self._learned)  # None: not byte-level ([Note: any tokenizer.json])
            if self._learned > vocab_size:
                raise ValueError(f"the tokenizer has {self._learned} tokens, more than vocab_size {vocab_size}")
        self._table = table  # id -> its bytes (byte-level vocabularies)

    @staticmethod
    def _byte_table(vocab: dict[str, int], added: dict[int, str], n: int) -> list[bytes] | None:
        """id -> bytes of every token when the model's pieces are in the byte-to-unicode alphabet
        (a byte-level BPE; an added special token is its own text, whatever its characters), else
        ``None``."""
        to_byte = {ch: b for b, ch in _bytes_to_unicode().items()}
        table = [b""] * n
        for piece, i in vocab.items():
            if any(ch not in to_byte for ch in piece):
                return None
            table[i] = bytes(to_byte[ch] for ch in piece)
        for i, content in added.items():
            table[i] = content.encode("utf-8")
        return table

    @classmethod
    def train(cls, corpus: torch.Tensor | bytes, vocab_size: int) -> CorpusTokenizer:
        """Learn a byte-level BPE of at most ``vocab_size`` ids from ``corpus`` (UTF-8 bytes, a
        uint8 tensor as :func:`~colossalai.data.load_corpus` returns); 256: the byte tokenizer."""
        _check_vocab_size(vocab_size)
        if vocab_size == BYTE_VOCAB_SIZE:
            return cls()
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        raw = corpus if isinstance(corpus, bytes) else bytes(corpus.numpy())
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's word split
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
            show_progress=False,
        )
        # A truncated corpus may end inside a character; the replacement only affects counting.
        bpe.train_from_iterator([raw.decode("utf-8", errors="replace")], trainer=trainer)
        return cls(vocab_size, bpe.to_str())

    @property
    def learned(self) -> int:
        """Ids that stand for text (the rest up to :attr:`vocab_size` are padding)."""
        return self._learned

    @property
    def kind(self) -> str:
        """'bytes', 'bpe' (byte-level) or, for another ``tokenizer.json``, ``'hf:'`` and its model
        (``'hf:BPE'`` for a SentencePiece-style BPE, ``'hf:Unigram'``), for summaries."""
        if self._bpe is None:
            return "bytes"
        return "bpe" if self._table is not None else f"hf:{type(self._bpe.model).__name__}"

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (N,) of ``text`` (long)."""
        if self._bpe is None:
            return _encode_bytes(text)
        return torch.tensor(self._bpe.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def encode_corpus(self, corpus: torch.Tensor) -> torch.Tensor:
        """The corpus (uint8 UTF-8 bytes, (N,)) as token ids: uint8 for bytes, else int32 (M,)."""
        if self._bpe is None:
            return corpus
        text = bytes(corpus.numpy()).decode("utf-8", errors="replace")
        return torch.tensor(self._bpe.encode(text, add_special_tokens=False).ids, dtype=torch.int32)

    def decode(self, tokens: torch.Tensor) -> str:
        """Token ids (any shape) back to text. A model may emit a sequence that is not valid UTF-8
        (a sample cut inside a character); such bytes stay, as ``\\xNN`` escapes (Python's own
        spelling), rather than lost to U+FFFD. Padding ids decode to nothing."""
        ids = tokens.flatten().tolist()
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {bad[:5]}")
        if self._table is None:  # the tokenizer's own decoder (byte fallback, word markers)
            return self._bpe.decode([i for i in ids if i < self._learned], skip_special_tokens=False)
        table, n = self._table, len(self._table)
        data = b"".join(table[i] for i in ids if i < n)
        return data.decode("utf-8", errors="backslashreplace")

    def save_hf(self, folder: str | os.PathLike) -> pathlib.Path | None:
        """Write the BPE as a Hugging Face ``tokenizer.json`` into ``folder`` (next to an exported
        model; ``tokenizers.Tokenizer.from_file`` reads it); the byte tokenizer writes nothing."""
        if self._bpe_json is None:
            return None
        path = pathlib.Path(folder) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self._bpe_json, encoding="utf-8")
        return path

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer (stored with checkpoints)."""
        return json.dumps({"format": _FORMAT, "vocab_size": self.vocab_size, "bpe": self._bpe_json})

    @classmethod
    def from_json(cls, text: str) -> CorpusTokenizer:
        """Inverse of :meth:`to_json`."""
        try:
            saved = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a saved CorpusTokenizer: {exc}") from None
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise ValueError(f"not a saved CorpusTokenizer (format {_FORMAT!r} expected)")
        return cls(saved["vocab_size"], saved["bpe"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CorpusTokenizer):
            return NotImplemented
        return self.vocab_size == other.vocab_size and self._bpe_json == other._bpe_json

    def __repr__(self) -> str:
        return f"CorpusTokenizer({self.kind}, vocab_size={self.vocab_size}, learned={self.learned})"
