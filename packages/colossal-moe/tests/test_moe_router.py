"""Routers: choices and weights, capacity against a counting reference, the auxiliary losses."""

import math

import pytest
import torch
from moe_testing import assert_close, reference_keep

from colossal.moe import MoEConfig, TopKRouter, capacity


def _router(**kw):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden=8, ffn_hidden=16, num_experts=4, **kw)
    return TopKRouter(cfg), torch.randn(50, 8)


@pytest.mark.parametrize("top_k,renormalize", [(1, True), (2, True), (2, False), (3, True)])
def test_topk_choices_and_weights(top_k, renormalize):
    router, x = _router(top_k=top_k, renormalize=renormalize, capacity_factor=None)
    r = router(x)
    probs = (x @ router.gate.weight.t()).softmax(-1)
    ranked = probs.argsort(-1, descending=True)[:, :top_k]
    assert torch.equal(r.expert, ranked)
    w = probs.gather(1, ranked)
    if top_k > 1 and renormalize:
        w = w / w.sum(-1, keepdim=True)
    assert_close(r.weight, w, "weights")
    assert r.keep.all() and r.capacity is None and r.dropped == 0


@pytest.mark.parametrize("top_k,cf", [(1, 1.0), (1, 0.5), (2, 1.0), (2, 1.25)])
def test_capacity_drops_match_counting_reference(top_k, cf):
    router, x = _router(top_k=top_k, capacity_factor=cf, min_capacity=1)
    with torch.no_grad():
        router.gate.weight[0] += 1.0  # skew the load so that some expert overflows
    x = x + 0.5
    r = router(x)
    cap = capacity(50, 4, top_k, cf, 1)
    assert cap == max(1, math.ceil(cf * 50 * top_k / 4)) == r.capacity
    keep = reference_keep(r.expert, 4, cap)
    assert torch.equal(r.keep, keep)
    assert r.dropped == int((~keep).sum()) > 0
    assert r.tokens_dropped == int((~keep).all(1).sum())
    assert int(r.expert_counts(4).max()) <= cap


def test_load_balancing_and_z_loss_formulas():
    router, x = _router(top_k=2, capacity_factor=None)
    r = router(x)
    logits = x @ router.gate.weight.t()
    probs = logits.softmax(-1)
    f = torch.zeros(4)
    for e in r.expert.reshape(-1).tolist():
        f[e] += 1.0 / 100  # 50 tokens x 2 choices
    assert_close(r.load_balancing_loss, 4 * (f * probs.mean(0)).sum(), "load balancing")
    assert_close(r.z_loss, (logits.exp().sum(-1).log() ** 2).mean(), "z loss")
    # uniform routing: loss 1 exactly
    with torch.no_grad():
        router.gate.weight.zero_()
    assert_close(router(x).load_balancing_loss * 1.0, torch.tensor(1.0), "uniform")


def test_jitter_only_in_training():
    router, x = _router(jitter=0.1, capacity_factor=None)
    router.eval()
    a, b = router(x), router(x)
    assert torch.equal(a.weight, b.weight)
    router.train()
    torch.manual_seed(1)
    c = router(x)
    assert not torch.equal(a.weight, c.weight)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(top_k=5), "top_k=5 exceeds num_experts=4"),
        (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
        (dict(capacity_factor=-1.0), "capacity_factor must be > 0"),
        (dict(expert="conv"), "expert must be one of"),
        (dict(jitter=1.5), "jitter"),
    ],
)
def test_config_errors_name_values(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(hidden=8, ffn_hidden=16, num_experts=4, **kw)
