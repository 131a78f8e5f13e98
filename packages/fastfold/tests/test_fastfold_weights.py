"""Parameters round-trip through OpenFold and AlphaFold naming (random weights -> export -> fresh
model -> identical outputs), and AlphaFold's layouts mean what AlphaFold's code computes with them
(Haiku-style einsums written here from AlphaFold's modules, float64)."""

import math

import numpy as np
import pytest
import torch
from fastfold_testutils import rand, rand_mask, randomize_, tiny_evo, tiny_extra, tiny_template

from fastfold import EvoformerStack, ExtraMSAStack, TemplatePairStack
from fastfold.weights import alphafold_params, load_alphafold_params, load_openfold_state_dict, openfold_state_dict

AF = "alphafold/alphafold_iteration/evoformer/"


def _models():
    return [
        (lambda: EvoformerStack(tiny_evo()).double(), lambda m: m(rand(3, 5, 12), rand(5, 5, 8), rand_mask(3, 5))),
        (lambda: ExtraMSAStack(tiny_extra()).double(), lambda m: m(rand(3, 5, 6), rand(5, 5, 8), rand_mask(3, 5))),
        (lambda: TemplatePairStack(tiny_template()).double(), lambda m: m(rand(2, 5, 5, 8))),
    ]


def _same_outputs(a, b, run):
    out_a, out_b = run(a.eval()), run(b.eval())
    for x, y in zip(out_a if isinstance(out_a, tuple) else (out_a,), out_b if isinstance(out_b, tuple) else (out_b,)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("idx", [0, 1, 2])
def test_openfold_round_trip(idx):
    make, run = _models()[idx]
    src = randomize_(make())
    prefix = ["evoformer.", "extra_msa_stack.", "template_embedder.template_pair_stack."][idx]
    sd = {"module." + k: v for k, v in openfold_state_dict(src, prefix).items()}
    sd["module.structure_module.linear_in.weight"] = torch.zeros(3)  # other modules' keys are ignored
    dst = make()
    load_openfold_state_dict(dst, sd)
    _same_outputs(src, dst, run)


def test_openfold_legacy_core_names():
    make, run = _models()[0]
    src = randomize_(make())
    legacy = {}
    for k, v in openfold_state_dict(src, "evoformer.").items():
        for old, new in (
            (".msa_transition.", ".core.msa_transition."),
            (".outer_product_mean.", ".core.outer_product_mean."),
        ):
            k = k.replace(old, new)
        legacy[k.replace(".pair_stack.", ".core.")] = v
    assert any(".core.tri_mul_in." in k for k in legacy)
    dst = make()
    load_openfold_state_dict(dst, legacy)
    _same_outputs(src, dst, run)


@pytest.mark.parametrize("idx", [0, 1, 2])
@pytest.mark.parametrize("nested", [False, True])
def test_alphafold_round_trip(idx, nested):
    make, run = _models()[idx]
    src = randomize_(make())
    params = alphafold_params(src)
    if nested:  # Haiku's {scope: {name: array}}
        tree = {}
        for k, v in params.items():
            scope, name = k.split("//")
            tree.setdefault(scope, {})[name] = v
        params = tree
    dst = make()
    load_alphafold_params(dst, params)
    _same_outputs(src, dst, run)


def _block0(params, scope):
    return {k.split("//")[1]: torch.as_tensor(v[0]) for k, v in params.items() if k.split("//")[0] == scope}


def _hk_ln(x, p):
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * p["scale"] + p["offset"]


def test_alphafold_layouts_have_alphafold_semantics():
    """Row attention, outer product mean and the incoming triangle update computed the way
    AlphaFold's Haiku modules compute them from the exported arrays equal the torch modules."""
    model = randomize_(EvoformerStack(tiny_evo(no_blocks=1)).double())
    params, it = alphafold_params(model), f"{AF}evoformer_iteration/"
    block = model.blocks[0]
    m, z, mask = rand(3, 5, 12), rand(5, 5, 8), rand_mask(3, 5)
    # msa_row_attention_with_pair_bias: einsums of AlphaFold's Attention module
    row = f"{it}msa_row_attention_with_pair_bias"
    att, qn, fn = _block0(params, f"{row}/attention"), _block0(params, f"{row}/query_norm"), _block0(params, row)
    x = _hk_ln(m, qn)
    nb = torch.einsum("qkc,ch->hqk", _hk_ln(z, _block0(params, f"{row}/feat_2d_norm")), fn["feat_2d_weights"])
    q = torch.einsum("bqa,ahc->bqhc", x, att["query_w"]) / math.sqrt(att["query_w"].shape[-1])
    k, v = torch.einsum("bka,ahc->bkhc", x, att["key_w"]), torch.einsum("bka,ahc->bkhc", x, att["value_w"])
    logits = torch.einsum("bqhc,bkhc->bhqk", q, k) + 1e9 * (mask[:, None, None, :] - 1) + nb[None]
    avg = torch.einsum("bhqk,bkhc->bqhc", torch.softmax(logits, -1), v)
    avg = avg * torch.sigmoid(torch.einsum("bqc,chv->bqhv", x, att["gating_w"]) + att["gating_b"])
    out = torch.einsum("bqhc,hco->bqo", avg, att["output_w"]) + att["output_b"]
    torch.testing.assert_close(block.msa_att_row(m, z, mask), out)
    # outer_product_mean: output_w [c, e, f] contracts left channel c and right channel e
    opm = f"{it}outer_product_mean"
    x = _hk_ln(m, _block0(params, f"{opm}/layer_norm_input"))
    lp, rp, o = (
        _block0(params, f"{opm}/left_projection"),
        _block0(params, f"{opm}/right_projection"),
        _block0(params, opm),
    )
    left, right = mask[..., None] * (x @ lp["weights"] + lp["bias"]), mask[..., None] * (x @ rp["weights"] + rp["bias"])
    act = torch.einsum("sic,sje,cef->ijf", left, right, o["output_w"]) + o["output_b"]
    act = act / (1e-3 + torch.einsum("si,sj->ij", mask, mask))[..., None]
    torch.testing.assert_close(block.outer_product_mean(m, mask), act)
    # triangle_multiplication_incoming: AlphaFold's equation is 'kjc,kic->ijc' on (left, right)
    tri = f"{it}triangle_multiplication_incoming"
    p = {n: _block0(params, f"{tri}/{n}") for n in ("left_projection", "right_projection", "left_gate", "right_gate")}
    p.update({n: _block0(params, f"{tri}/{n}") for n in ("gating_linear", "output_projection")})
    pmask = rand_mask(5, 5, seed=9)
    x = _hk_ln(z, _block0(params, f"{tri}/layer_norm_input"))
    lin = lambda n: x @ p[n]["weights"] + p[n]["bias"]
    left = pmask[..., None] * lin("left_projection") * torch.sigmoid(lin("left_gate"))
    right = pmask[..., None] * lin("right_projection") * torch.sigmoid(lin("right_gate"))
    act = _hk_ln(torch.einsum("kjc,kic->ijc", left, right), _block0(params, f"{tri}/center_layer_norm"))
    act = (act @ p["output_projection"]["weights"] + p["output_projection"]["bias"]) * torch.sigmoid(
        lin("gating_linear")
    )
    torch.testing.assert_close(block.pair_stack.tri_mul_in(z, pmask), act)


def test_loading_errors():
    model = EvoformerStack(tiny_evo())
    params = alphafold_params(model)
    key = next(iter(params))
    with pytest.raises(ValueError, match="AlphaFold params lack"):
        load_alphafold_params(model, {k: v for k, v in params.items() if k != key})
    with pytest.raises(ValueError, match="stacks 1 blocks, the module has 2"):
        load_alphafold_params(model, {k: v[:1] for k, v in params.items()})
    sd = openfold_state_dict(model)
    with pytest.raises(ValueError, match=r"has shape \(3,\), expected"):
        load_openfold_state_dict(model, {**sd, "blocks.0.msa_att_row.layer_norm_m.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="lacks 1 parameters"):
        load_openfold_state_dict(model, {k: v for k, v in sd.items() if k != "linear.bias"})
    with pytest.raises(NotImplementedError, match="supported for EvoformerStack"):
        alphafold_params(torch.nn.Linear(2, 2))
    assert isinstance(params[key], np.ndarray)
