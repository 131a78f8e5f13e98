"""Every sub-module against a float64 reference written from the AlphaFold 2 supplementary
algorithms (random weights, random inputs, masks with zeros). Tolerance 1e-10: both sides are
float64 and differ only by summation order."""

import pytest
import torch
from fastfold_testutils import (
    rand,
    rand_mask,
    randomize_,
    ref_evoformer_block,
    ref_global_col,
    ref_msa_col,
    ref_msa_row,
    ref_opm,
    ref_pair_updates,
    ref_transition,
    ref_tri_att,
    ref_tri_mul,
    tiny_evo,
    tiny_extra,
    tiny_template,
)

from fastfold import EvoformerStack, ExtraMSAStack, TemplatePairStack
from fastfold.model import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    MSATransition,
    OuterProductMean,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from fastfold.model.pair_stack import TEMPLATE_PAIR_ORDER

S, R, CM, CZ = 4, 7, 12, 8
TOL = dict(rtol=1e-10, atol=1e-10)


def _mk(cls, *args):
    return randomize_(cls(*args).double())


@pytest.fixture
def inputs():
    return rand(S, R, CM, seed=1), rand(R, R, CZ, seed=2), rand_mask(S, R, seed=3), rand_mask(R, R, seed=4)


def test_msa_row_attention_with_pair_bias(inputs):
    m, z, msa_mask, _ = inputs
    mod = _mk(MSARowAttentionWithPairBias, CM, CZ, 4, 2)
    torch.testing.assert_close(mod(m, z, msa_mask), ref_msa_row(mod, m, z, msa_mask), **TOL)


def test_msa_column_attention(inputs):
    m, _, msa_mask, _ = inputs
    mod = _mk(MSAColumnAttention, CM, 4, 2)
    torch.testing.assert_close(mod(m, msa_mask), ref_msa_col(mod, m, msa_mask), **TOL)


def test_msa_column_global_attention(inputs):
    m, _, msa_mask, _ = inputs
    mod = _mk(MSAColumnGlobalAttention, CM, 3, 2)
    torch.testing.assert_close(mod(m, msa_mask), ref_global_col(mod, m, msa_mask), **TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_msa_transition(inputs, masked):
    m, _, msa_mask, _ = inputs
    mod = _mk(MSATransition, CM, 4)
    mask = msa_mask if masked else None
    torch.testing.assert_close(mod(m, mask), ref_transition(mod, m, mask), **TOL)


def test_outer_product_mean(inputs):
    m, _, msa_mask, _ = inputs
    mod = _mk(OuterProductMean, CM, CZ, 3)
    torch.testing.assert_close(mod(m, msa_mask), ref_opm(mod, m, msa_mask), **TOL)


@pytest.mark.parametrize(
    "cls,outgoing", [(TriangleMultiplicationOutgoing, True), (TriangleMultiplicationIncoming, False)]
)
def test_triangle_multiplicative_update(inputs, cls, outgoing):
    _, z, _, pair_mask = inputs
    mod = _mk(cls, CZ, 5)
    torch.testing.assert_close(mod(z, pair_mask), ref_tri_mul(mod, z, pair_mask, outgoing), **TOL)


@pytest.mark.parametrize("cls,starting", [(TriangleAttentionStartingNode, True), (TriangleAttentionEndingNode, False)])
def test_triangle_attention(inputs, cls, starting):
    _, z, _, pair_mask = inputs
    mod = _mk(cls, CZ, 4, 2)
    torch.testing.assert_close(mod(z, pair_mask), ref_tri_att(mod, z, pair_mask, starting), **TOL)


def test_evoformer_stack(inputs):
    m, z, msa_mask, pair_mask = inputs
    stack = randomize_(EvoformerStack(tiny_evo()).double()).eval()
    m_out, z_out, s_out = stack(m, z, msa_mask, pair_mask)
    m_ref, z_ref = m, z
    for block in stack.blocks:
        m_ref, z_ref = ref_evoformer_block(block, m_ref, z_ref, msa_mask, pair_mask)
    torch.testing.assert_close(m_out, m_ref, **TOL)
    torch.testing.assert_close(z_out, z_ref, **TOL)
    torch.testing.assert_close(s_out, m_ref[0] @ stack.linear.weight.T + stack.linear.bias, **TOL)


def test_extra_msa_stack(inputs):
    _, z, msa_mask, pair_mask = inputs
    m = rand(S, R, 6, seed=5)
    stack = randomize_(ExtraMSAStack(tiny_extra()).double()).eval()
    m_ref, z_ref = m, z
    for block in stack.blocks:
        m_ref, z_ref = ref_evoformer_block(block, m_ref, z_ref, msa_mask, pair_mask, global_col=True)
    torch.testing.assert_close(stack(m, z, msa_mask, pair_mask), z_ref, **TOL)


def test_template_pair_stack(inputs):
    _, _, _, pair_mask = inputs
    t = rand(2, R, R, 8, seed=6)
    stack = randomize_(TemplatePairStack(tiny_template()).double()).eval()
    refs = []
    for ti in t:
        for block in stack.blocks:
            ti = ref_pair_updates(block, ti, pair_mask, TEMPLATE_PAIR_ORDER)
        mu, var = ti.mean(-1, keepdim=True), ti.var(-1, unbiased=False, keepdim=True)
        refs.append((ti - mu) / torch.sqrt(var + 1e-5) * stack.layer_norm.weight + stack.layer_norm.bias)
    torch.testing.assert_close(stack(t, pair_mask.expand(2, R, R)), torch.stack(refs), **TOL)


def test_batch_dims_broadcast(inputs):
    m, z, msa_mask, pair_mask = inputs
    stack = randomize_(EvoformerStack(tiny_evo(no_blocks=1)).double()).eval()
    single = stack(m, z, msa_mask, pair_mask)
    batched = stack(torch.stack([m, m]), torch.stack([z, z]), torch.stack([msa_mask] * 2), torch.stack([pair_mask] * 2))
    for a, b in zip(single, batched):
        torch.testing.assert_close(b[1], a, **TOL)
