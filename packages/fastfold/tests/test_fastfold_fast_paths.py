"""The inference-only paths (no autograd: fused scaled-dot-product attention with the biases as one
mask, the triangle update written over its operand buffer, in-place gates, the outer product mean
contracted in either order) against the float64 references of the supplementary algorithms, with
masked keys and without, unchunked, chunked and in place. Tolerance 1e-10: float64 on both sides,
only the summation order differs."""

import pytest
import torch
from fastfold_testutils import (
    rand,
    rand_mask,
    randomize_,
    ref_evoformer_block,
    ref_msa_col,
    ref_msa_row,
    ref_opm,
    ref_tri_att,
    ref_tri_mul,
    tiny_evo,
)

from fastfold import EvoformerStack
from fastfold.model import (
    MSAColumnAttention,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from fastfold.ops import attention_core

S, R, CM, CZ = 4, 9, 12, 8
TOL = dict(rtol=1e-10, atol=1e-10)


def _mk(cls, *args):
    return randomize_(cls(*args).double())


@pytest.fixture(params=["masked", "unmasked"])
def inputs(request):
    msa_mask, pair_mask = rand_mask(S, R, seed=3), rand_mask(R, R, seed=4)
    if request.param == "unmasked":  # all-zero key-mask biases are dropped from the fused mask
        msa_mask, pair_mask = torch.ones_like(msa_mask), torch.ones_like(pair_mask)
    return rand(S, R, CM, seed=1), rand(R, R, CZ, seed=2), msa_mask, pair_mask


def _run(fn, chunk_size, inplace, like):
    """``fn(chunk_size, accumulate_into)`` under no_grad; in place it adds into a copy of ``like``
    (random, so a wrong accumulation shows), returned minus ``like``."""
    with torch.no_grad():
        if not inplace:
            return fn(chunk_size, None)
        acc = like.clone()
        out = fn(chunk_size, acc)
        assert out.data_ptr() == acc.data_ptr()
        return out - like


CASES = [(None, False), (2, False), (3, True), (None, True)]


@pytest.mark.parametrize("chunk_size,inplace", CASES)
def test_msa_attention(inputs, chunk_size, inplace):
    m, z, msa_mask, _ = inputs
    row, col = _mk(MSARowAttentionWithPairBias, CM, CZ, 4, 2), _mk(MSAColumnAttention, CM, 4, 2)
    fn = lambda c, acc: row(m, z, msa_mask, c, accumulate_into=acc)
    torch.testing.assert_close(_run(fn, chunk_size, inplace, m), ref_msa_row(row, m, z, msa_mask), **TOL)
    fn = lambda c, acc: col(m, msa_mask, c, accumulate_into=acc)
    torch.testing.assert_close(_run(fn, chunk_size, inplace, m), ref_msa_col(col, m, msa_mask), **TOL)


@pytest.mark.parametrize("chunk_size,inplace", CASES)
@pytest.mark.parametrize(
    "mul,att,outgoing",
    [
        (TriangleMultiplicationOutgoing, TriangleAttentionStartingNode, True),
        (TriangleMultiplicationIncoming, TriangleAttentionEndingNode, False),
    ],
)
def test_triangle_updates(inputs, chunk_size, inplace, mul, att, outgoing):
    _, z, _, pair_mask = inputs
    mod = _mk(mul, CZ, 5)
    fn = lambda c, acc: mod(z, pair_mask, c, accumulate_into=acc)
    torch.testing.assert_close(_run(fn, chunk_size, inplace, z), ref_tri_mul(mod, z, pair_mask, outgoing), **TOL)
    mod = _mk(att, CZ, 4, 2)
    fn = lambda c, acc: mod(z, pair_mask, c, accumulate_into=acc)
    torch.testing.assert_close(_run(fn, chunk_size, inplace, z), ref_tri_att(mod, z, pair_mask, outgoing), **TOL)


@pytest.mark.parametrize("order", ["outer", "b", "a"])
@pytest.mark.parametrize("chunk_size,inplace", CASES)
def test_outer_product_mean_every_order(order, chunk_size, inplace, monkeypatch):
    """[Note: outer product mean contraction order]: each of the three orders equals the reference
    (float64), with and without autograd, chunked and in place."""
    m, mask = rand(6, R, CM, seed=7), rand_mask(6, R, seed=8)
    mod = _mk(OuterProductMean, CM, CZ, 5)
    monkeypatch.setattr(mod, "_order", lambda *shape: order)
    with torch.enable_grad():
        torch.testing.assert_close(mod(m, mask, chunk_size), ref_opm(mod, m, mask), **TOL)  # training path too
    like = rand(R, R, CZ, seed=9)
    fn = lambda c, acc: mod(m, mask, c, accumulate_into=acc)
    torch.testing.assert_close(_run(fn, chunk_size, inplace, like), ref_opm(mod, m, mask), **TOL)


def test_outer_product_mean_order_choice():
    """The cheapest order by multiply-adds: W into b for few sequences, the outer product first for
    many, W into the local a when the rows are a DAP slice of the columns (c_hidden 5, c_z 4)."""
    mod = _mk(OuterProductMean, CM, CZ, 5)
    assert [mod._order(n_seq, R, R) for n_seq in (2, 4, 20)] == ["b", "b", "outer"]
    assert mod._order(2, R // 2, R) == "a" and mod._order(20, R // 2, R) == "outer"


@pytest.mark.parametrize("chunk_size,inplace", CASES)
def test_evoformer_stack_inference(inputs, chunk_size, inplace):
    m, z, msa_mask, pair_mask = inputs
    stack = randomize_(EvoformerStack(tiny_evo()).double()).eval()
    with torch.no_grad():
        m_out, z_out, _ = stack(m, z, msa_mask, pair_mask, chunk_size=chunk_size, inplace=inplace)
    m_ref, z_ref = m, z
    for block in stack.blocks:
        m_ref, z_ref = ref_evoformer_block(block, m_ref, z_ref, msa_mask, pair_mask)
    torch.testing.assert_close(m_out, m_ref, **TOL)
    torch.testing.assert_close(z_out, z_ref, **TOL)


def test_attention_core_masks():
    """Fused path (no grad) equals the eager softmax for every combination of a key mask (zero or
    not) and a pair bias; biases that do not broadcast are a ValueError naming them."""
    q, k, v = rand(3, 2, 5, 4, seed=1), rand(3, 2, 6, 4, seed=2), rand(3, 2, 6, 4, seed=3)
    pair = rand(1, 2, 5, 6, seed=4)
    masked = 1e9 * (rand_mask(3, 1, 1, 6, seed=5) - 1)
    zero_keys, one_d = torch.zeros(3, 1, 1, 6), rand(6, seed=6)  # one_d: a 1-D bias over the keys
    for biases in ([], [pair], [zero_keys], [masked], [masked, pair], [zero_keys, pair], [one_d]):
        ref = torch.softmax(q @ k.transpose(-1, -2) + sum(biases, torch.zeros(())), -1) @ v
        with torch.no_grad():
            torch.testing.assert_close(attention_core(q, k, v, biases), ref, **TOL)
        qg = q.clone().requires_grad_()
        torch.testing.assert_close(attention_core(qg, k, v, biases), ref, **TOL)
    with pytest.raises(ValueError, match=r"biases\[1\] of shape \(2, 5, 5\)"):
        attention_core(q, k, v, [pair, torch.zeros(2, 5, 5)])
