"""The embedded default corpus (Python standard-library source), its tokenizer and its datasets."""

from colossalai.data.corpus import VOCAB_SIZE, decode, encode, load_corpus, read_text_corpus, stdlib_files
from colossalai.data.dataset import ResumableDistributedSampler, TokenWindows
from colossalai.data.tokenizer import BYTE_VOCAB_SIZE, CorpusTokenizer

__all__ = [
    "VOCAB_SIZE",
    "BYTE_VOCAB_SIZE",
    "CorpusTokenizer",
    "decode",
    "encode",
    "load_corpus",
    "read_text_corpus",
    "stdlib_files",
    "ResumableDistributedSampler",
    "TokenWindows",
    "corpus_dataset",
]


def corpus_dataset(
    seq_len: int = 64, max_bytes: int = 4_000_000, tokenizer: CorpusTokenizer | None = None
) -> TokenWindows:
    """The embedded corpus, tokenised by ``tokenizer`` (default: bytes), cut into (T,) windows of
    ``seq_len`` tokens."""
    corpus = load_corpus(max_bytes)
    return TokenWindows(corpus if tokenizer is None else tokenizer.encode_corpus(corpus), seq_len)
