"""Config defaults (AlphaFold 2's) and the clear errors for bad configs and bad inputs."""

import pytest
import torch
from fastfold_testutils import rand, tiny_evo

from fastfold import EvoformerConfig, EvoformerStack, ExtraMSAConfig, TemplatePairConfig, TemplatePairStack


def test_alphafold_defaults():
    e = EvoformerConfig()
    assert (e.c_m, e.c_z, e.c_s, e.no_blocks) == (256, 128, 384, 48)
    assert (e.no_heads_msa, e.c_hidden_msa_att, e.no_heads_pair, e.c_hidden_pair_att) == (8, 32, 4, 32)
    assert (e.c_hidden_opm, e.c_hidden_mul, e.transition_n) == (32, 128, 4)
    assert (e.msa_dropout, e.pair_dropout) == (0.15, 0.25)
    x = ExtraMSAConfig()
    assert (x.c_m, x.c_z, x.no_heads_msa, x.c_hidden_msa_att, x.no_blocks) == (64, 128, 8, 8, 4)
    t = TemplatePairConfig()
    assert (t.c_t, t.no_heads, t.c_hidden_tri_att, t.c_hidden_tri_mul, t.pair_transition_n, t.no_blocks) == (
        64,
        4,
        16,
        64,
        2,
        2,
    )


@pytest.mark.parametrize(
    "kw,match", [({"c_m": 0}, "c_m"), ({"no_heads_msa": 2.5}, "no_heads_msa"), ({"msa_dropout": 1.0}, "msa_dropout")]
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EvoformerConfig(**kw)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        EvoformerConfig(256)


@pytest.fixture(scope="module")
def stack():
    return EvoformerStack(tiny_evo(no_blocks=1)).double()


def test_shape_errors(stack):
    m, z = rand(3, 5, 12), rand(5, 5, 8)
    with pytest.raises(ValueError, match=r"m: expected \[\*, S, R, c_m=12\]"):
        stack(rand(3, 5, 11), z)
    with pytest.raises(ValueError, match="z: expected"):
        stack(m, rand(6, 6, 8))
    with pytest.raises(ValueError, match="msa_mask: expected shape"):
        stack(m, z, msa_mask=torch.ones(3, 6))
    with pytest.raises(ValueError, match="pair_mask: expected shape"):
        stack(m, z, pair_mask=torch.ones(5, 4))
    with pytest.raises(TypeError, match="m must be a tensor"):
        stack([1, 2], z)


def test_mode_errors(stack):
    m, z = rand(3, 5, 12), rand(5, 5, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        stack(m, z, chunk_size=0)
    with pytest.raises(ValueError, match="inplace=True is an inference mode"):
        stack(m, z, inplace=True)
    with pytest.raises(ValueError, match="t: expected"):
        TemplatePairStack(TemplatePairConfig(c_t=8, no_blocks=1))(rand(2, 5, 4, 8))
