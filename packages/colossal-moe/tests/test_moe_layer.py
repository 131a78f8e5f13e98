"""One-process MoE layer against a token-by-token reference; experts' grouped matmul."""

import pytest
import torch
from moe_testing import assert_close, reference_moe

from colossal.moe import MoE, MoEConfig, grouped_mm, moe_aux_loss

CASES = [
    dict(top_k=1, capacity_factor=1.0, expert="mlp"),
    dict(top_k=2, capacity_factor=1.0, expert="mlp"),
    dict(top_k=1, capacity_factor=None, expert="swiglu"),
    dict(top_k=2, capacity_factor=None, expert="mlp", renormalize=False),
    dict(top_k=2, capacity_factor=0.5, expert="swiglu"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_layer_matches_token_by_token_reference(case):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden=16, ffn_hidden=32, num_experts=4, min_capacity=1, **case)
    moe = MoE(cfg)
    x = torch.randn(3, 20, 16, requires_grad=True)
    gy = torch.randn(3, 20, 16)
    y = moe(x)
    (y * gy).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    gx = x.grad.clone()
    x.grad = None
    moe.zero_grad()
    ref, keep = reference_moe(moe, x.view(-1, 16))
    (ref.view(3, 20, 16) * gy).sum().backward()
    assert_close(y, ref.view(3, 20, 16), "output")
    assert_close(gx, x.grad, "input grad")
    for n, p in moe.named_parameters():
        assert_close(grads[n], p.grad, f"grad {n}")
    assert moe.stats.dropped == int((~keep).sum())
    assert moe.stats.tokens_dropped == int((~keep).all(1).sum())
    if cfg.capacity_factor is None:
        assert moe.stats.dropped == 0
    # fully dropped tokens give zero output, so they pass through a residual unchanged
    assert (y.detach().view(-1, 16)[(~keep).all(1)] == 0).all()


def test_aux_loss_is_weighted_sum_and_collected():
    torch.manual_seed(0)
    cfg = MoEConfig(hidden=16, ffn_hidden=32, num_experts=4, aux_loss_coef=0.5, z_loss_coef=0.25)
    model = torch.nn.Sequential(MoE(cfg), MoE(cfg))
    assert moe_aux_loss(model) is None
    x = torch.randn(10, 16)
    model(x)
    parts = [0.5 * m.stats.load_balancing_loss + 0.25 * m.stats.z_loss for m in model]
    assert abs(moe_aux_loss(model).item() - sum(parts)) < 1e-6
    moe_aux_loss(model).backward()
    assert model[0].router.gate.weight.grad.abs().sum() > 0


def test_a_trained_layer_deep_copies_like_a_plain_module():
    """An EMA or snapshot copy after a training forward: the copy's aux_loss is the value, detached
    (torch refuses to deep-copy a tensor inside a graph); the original keeps its graph."""
    import copy
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), MoE(MoEConfig(hidden=16, ffn_hidden=32, num_experts=4)))
    model(torch.randn(10, 16))
    twin = copy.deepcopy(model)
    assert twin[1].aux_loss.grad_fn is None and twin[1].aux_loss.item() == model[1].aux_loss.item()
    assert model[1].aux_loss.grad_fn is not None
    x = torch.randn(3, 16)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    assert pickle.loads(pickle.dumps(model))[1].aux_loss.item() == model[1].aux_loss.item()


@pytest.mark.parametrize("dtype,width", [(torch.float32, 16), (torch.float64, 16), (torch.float32, 6)])
def test_grouped_mm_matches_segment_products(dtype, width):
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 7, 0, 5])
    x = torch.randn(15, width, dtype=dtype, requires_grad=True)
    w = torch.randn(5, width, 8, dtype=dtype, requires_grad=True)
    y = grouped_mm(x, w, counts)
    y.sum().backward()  # a zero-stride gradient, which torch._grouped_mm's backward rejects alone
    ref = torch.cat([xs @ w[e] for e, xs in enumerate(x.detach().split(counts.tolist()))])
    assert_close(y, ref, "grouped_mm")
    assert w.grad[1].abs().sum() == 0 and w.grad[0].abs().sum() > 0
    with pytest.raises(ValueError, match="x has 15 rows but counts sum to 14"):
        grouped_mm(x, w, counts - torch.tensor([0, 0, 1, 0, 0]))


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
def test_bfloat16_layer_follows_float32(expert):
    """bf16 experts (grouped matmul in bf16) with the router in fp32: within bf16 rounding of fp32."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden=64, ffn_hidden=128, num_experts=4, top_k=2, capacity_factor=None, expert=expert))
    x = torch.randn(100, 64)
    ref = moe(x)
    low = MoE.from_dense(moe, None).to(torch.bfloat16)
    xb = x.bfloat16().requires_grad_()
    y = low(xb)
    y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16 and low.experts.w_in.grad.dtype == torch.bfloat16
    assert_close(y.float(), ref, "bf16 output", tol=2e-2)


def test_expert_blocks_split_runs_of_experts():
    from colossal.moe.experts import expert_blocks

    # 10 bytes a row, 40 bytes a block: at most 4 rows, or one expert that alone has more
    assert expert_blocks([3, 0, 1, 6, 2, 2, 0], 10, 40) == [(0, 3, 0, 4), (3, 4, 4, 10), (4, 7, 10, 14)]
    assert expert_blocks([0, 0], 10, 40) == [(0, 2, 0, 0)]
    assert expert_blocks([5], 10, 1) == [(0, 1, 0, 5)]


@pytest.mark.parametrize(
    "block_bytes,dtype,activation",
    [(1, torch.float32, "gelu_tanh"), (600, torch.float32, "relu"), (600, torch.float32, "silu"),
     (1 << 20, torch.float32, "gelu"), (1 << 20, torch.float64, "gelu_tanh")],
)  # fmt: skip
def test_mlp_expert_blocks_match_reference(monkeypatch, block_bytes, dtype, activation):
    """Experts run one block of experts at a time (every expert alone, runs of a few, all at once;
    float64 takes the per-expert path): outputs and every gradient equal the token-by-token
    reference, and the idle expert's gradients are exactly zero."""
    import colossal.moe.experts as experts

    monkeypatch.setattr(experts, "BLOCK_BYTES", block_bytes)  # 128-byte rows: 600 bytes = 4 rows
    torch.manual_seed(0)
    cfg = MoEConfig(hidden=16, ffn_hidden=32, num_experts=5, top_k=2, capacity_factor=None, activation=activation)
    moe = MoE(cfg).to(dtype)
    with torch.no_grad():
        moe.router.gate.weight[4] = -10.0  # expert 4 is never chosen by these positive inputs
    x = (torch.rand(30, 16, dtype=dtype) + 0.1).requires_grad_()
    gy = torch.randn(30, 16, dtype=dtype)
    y = moe(x)
    (y * gy).sum().backward()
    assert moe.stats.expert_counts[4] == 0
    assert ("cpu", torch.float32) not in experts._REFUSED  # float32 ran torch._grouped_mm, not the fallback
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    gx, x.grad = x.grad.clone(), None
    moe.zero_grad()
    ref, _ = reference_moe(moe, x)
    (ref * gy).sum().backward()
    assert_close(y, ref, "output")
    assert_close(gx, x.grad, "input grad")
    for n, p in moe.named_parameters():
        assert_close(grads[n], p.grad, f"grad {n}")
    for n in ("w_in", "b_in", "w_out", "b_out"):
        assert (grads[f"experts.{n}"][4] == 0).all()


@pytest.mark.parametrize("cast", ["to_bf16", "half", "bfloat16", "to_device_dtype"])
def test_low_precision_cast_keeps_router_float32(cast):
    """``.to(bf16)``, ``.half()``, ``.bfloat16()`` cast the experts but leave the gate float32 and
    unrounded (as Switch does); routing of low-precision inputs equals the fp32 router's on the same
    inputs, and the gate's gradient is float32."""
    torch.manual_seed(0)
    cfg = MoEConfig(hidden=32, ffn_hidden=64, num_experts=8, top_k=2, capacity_factor=None)
    moe = MoE(cfg)
    gate = moe.router.gate.weight.detach().clone()
    low = {
        "to_bf16": lambda m: m.to(torch.bfloat16),
        "half": lambda m: m.half(),
        "bfloat16": lambda m: m.bfloat16(),
        "to_device_dtype": lambda m: m.to("cpu", torch.bfloat16),
    }[cast](moe)
    dtype = torch.float16 if cast == "half" else torch.bfloat16
    assert low.router.gate.weight.dtype == torch.float32 and torch.equal(low.router.gate.weight, gate)
    assert low.experts.w_in.dtype == dtype
    x = torch.randn(200, 32).to(dtype)
    routing = low.router(x)
    logits = x.float() @ gate.t()  # the fp32 reference router on the same (rounded) inputs
    weight, expert = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    assert torch.equal(routing.expert, expert)
    torch.testing.assert_close(routing.weight, weight / weight.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    y = low(x.requires_grad_())
    (y.float().square().mean() + low.aux_loss).backward()
    assert y.dtype == dtype and low.router.gate.weight.grad.dtype == torch.float32
    assert low.router.gate.weight.grad.abs().sum() > 0
    low.float()  # widening applies as given
    assert low.experts.w_in.dtype == torch.float32 and low.to(torch.float64).router.gate.weight.dtype == torch.float64
