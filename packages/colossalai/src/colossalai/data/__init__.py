"""The embedded default corpus (Python standard-library source, byte-level) and its datasets."""

from colossalai.data.corpus import VOCAB_SIZE, decode, encode, load_corpus, stdlib_files
from colossalai.data.dataset import ResumableDistributedSampler, TokenWindows

__all__ = [
    "VOCAB_SIZE",
    "decode",
    "encode",
    "load_corpus",
    "stdlib_files",
    "ResumableDistributedSampler",
    "TokenWindows",
    "corpus_dataset",
]


def corpus_dataset(seq_len: int = 64, max_bytes: int = 4_000_000) -> TokenWindows:
    """The embedded corpus cut into (T,) windows of ``seq_len`` tokens."""
    return TokenWindows(load_corpus(max_bytes), seq_len)
