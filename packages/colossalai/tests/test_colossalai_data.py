"""The embedded corpus and the resumable sampler."""

import pytest
import torch

from colossalai.data import ResumableDistributedSampler, TokenWindows, decode, encode, load_corpus, stdlib_files


def test_corpus_is_deterministic_python_source():
    a, b = load_corpus(50_000), load_corpus(50_000)
    assert a.dtype == torch.uint8 and a.numel() == 50_000 and torch.equal(a, b)
    assert len(list(stdlib_files())) > 100
    assert "def " in decode(a[:20_000])


def test_corpus_leaves_out_the_generated_build_configuration(tmp_path):
    """``_sysconfigdata_*.py`` (one dict of compiler flags, different on every build) is not code."""
    (tmp_path / "_sysconfigdata__linux_x86_64-linux-gnu.py").write_text("build_time_vars = {'CC': 'gcc'}\n")
    (tmp_path / "abc.py").write_text("def f():\n    return 1\n")
    assert [p.name for p in stdlib_files(tmp_path)] == ["abc.py"]
    assert decode(load_corpus(1_000, tmp_path)) == "def f():\n    return 1\n\n\n"


def test_windows_are_shifted_pairs():
    ds = TokenWindows(torch.arange(0, 100) % 256, 10)
    assert len(ds) == 9
    x, y = ds[3]
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))
    assert decode(encode("héllo")) == "héllo"


def test_decode_keeps_invalid_bytes_as_escapes():
    """A sampled byte sequence that is not valid UTF-8 shows its bytes, not U+FFFD."""
    tokens = torch.tensor([*encode("é="), 0xFF, 0xE2, 0x82])  # a stray byte, a cut-off '€'
    assert decode(tokens) == "é=\\xff\\xe2\\x82"
    assert "\ufffd" not in decode(torch.arange(256))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_global_batches_do_not_depend_on_world_size(world):
    ds = TokenWindows(torch.arange(1000) % 256, 4)
    global_batch = 8
    per_rank = [list(ResumableDistributedSampler(ds, num_replicas=world, rank=r, seed=1)) for r in range(world)]
    ref = list(ResumableDistributedSampler(ds, num_replicas=1, rank=0, seed=1))
    b = global_batch // world
    for step in range(5):
        got = sorted(i for r in range(world) for i in per_rank[r][step * b : (step + 1) * b])
        assert got == sorted(ref[step * global_batch : (step + 1) * global_batch])


def test_resume_position_continues_the_sequence():
    ds = TokenWindows(torch.arange(1000) % 256, 4)
    full = list(ResumableDistributedSampler(ds, num_replicas=2, rank=1, seed=0))
    s = ResumableDistributedSampler(ds, num_replicas=2, rank=1, seed=0)
    s.set_position(0, 12)
    assert list(s) == full[6:] and len(s) == len(full) - 6
    with pytest.raises(ValueError, match="multiple"):
        s.set_position(0, 3)
