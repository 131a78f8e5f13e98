"""Chunked and in-place inference equal unchunked inference (float32, to 1e-6: the chunks run the
same kernels on row slices, so only BLAS blocking can change the last bits)."""

import pytest
import torch
from fastfold_testutils import rand, rand_mask, randomize_, tiny_evo, tiny_extra, tiny_template

from fastfold import EvoformerStack, ExtraMSAStack, TemplatePairStack
from fastfold.chunk import chunk_apply

F32 = torch.float32
TOL = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def data():
    return rand(5, 9, 12, seed=1, dtype=F32), rand(9, 9, 8, seed=2, dtype=F32), rand_mask(5, 9, seed=3, dtype=F32)


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("inplace", [False, True])
def test_evoformer_chunked_equals_unchunked(data, chunk_size, inplace):
    m, z, msa_mask = data
    pair_mask = rand_mask(9, 9, seed=4, dtype=F32)
    stack = randomize_(EvoformerStack(tiny_evo()), std=0.2).eval()
    with torch.no_grad():
        ref = stack(m, z, msa_mask, pair_mask)
        m_in, z_in = m.clone(), z.clone()
        out = stack(m, z, msa_mask, pair_mask, chunk_size=chunk_size, inplace=inplace)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.equal(m, m_in) and torch.equal(z, z_in), "inputs must not be mutated"


@pytest.mark.parametrize("inplace", [False, True])
def test_extra_msa_and_template_chunked(data, inplace):
    _, z, msa_mask = data
    m = rand(5, 9, 6, seed=5, dtype=F32)
    extra = randomize_(ExtraMSAStack(tiny_extra()), std=0.2).eval()
    template = randomize_(TemplatePairStack(tiny_template()), std=0.2).eval()
    t = rand(2, 9, 9, 8, seed=6, dtype=F32)
    with torch.no_grad():
        torch.testing.assert_close(extra(m, z, msa_mask, chunk_size=3, inplace=inplace), extra(m, z, msa_mask), **TOL)
        torch.testing.assert_close(template(t, chunk_size=2, inplace=inplace), template(t), **TOL)


def test_chunk_apply_pieces_and_accumulate():
    x, w = rand(7, 3, dtype=F32), rand(1, 3, dtype=F32)  # w broadcasts along the chunked axis
    fn = lambda a, b: a * b + 1
    torch.testing.assert_close(chunk_apply(fn, [x, w], [0, 0], 2, 0), fn(x, w), rtol=0, atol=0)
    acc = torch.ones(7, 3)
    out = chunk_apply(fn, [x, w], [0, 0], 3, 0, accumulate_into=acc)
    assert out is acc
    torch.testing.assert_close(acc, 1 + fn(x, w), rtol=0, atol=0)
    with pytest.raises(ValueError, match="disagree"):
        chunk_apply(fn, [x, rand(5, 3)], [0, 0], 2, 0)
