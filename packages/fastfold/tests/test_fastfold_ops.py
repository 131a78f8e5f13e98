"""Fused operators: semantics of the pure-torch path, and the compiled path equal to it (float32,
1e-5: Inductor reassociates the reductions of softmax/layer norm)."""

import pytest
import torch
import torch.nn.functional as F

from fastfold.ops import (
    OpsBackend,
    bias_dropout_add,
    get_ops_backend,
    layer_norm,
    mask_bias,
    set_ops_backend,
    sigmoid_gate,
    softmax_with_biases,
)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=g)
    bias = torch.randn(1, 3, 5, 7, generator=g)
    mask = (torch.rand(2, 1, 1, 7, generator=g) > 0.3).float()
    return x, bias, mask


def test_softmax_with_biases_matches_definition():
    x, bias, mask = _inputs()
    out = softmax_with_biases(x, [bias, mask_bias(mask, 1e9)])
    ref = torch.softmax(x + bias + 1e9 * (mask - 1), -1)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch.all(out[mask.expand_as(out) == 0] == 0)
    with pytest.raises(ValueError, match=r"biases\[0\] of shape \(4,\) does not broadcast"):
        softmax_with_biases(x, [torch.zeros(4)])


def test_layer_norm_and_gate():
    x, bias, _ = _inputs()
    w, b = torch.randn(7), torch.randn(7)
    torch.testing.assert_close(layer_norm(x, w, b), F.layer_norm(x, (7,), w, b, 1e-5))
    torch.testing.assert_close(sigmoid_gate(x, bias), torch.sigmoid(bias) * x)
    with pytest.raises(ValueError, match="7 channels"):
        layer_norm(x, torch.ones(6), torch.zeros(6))


@pytest.mark.parametrize("shared_dim", [-3, -2])
def test_bias_dropout_add_shares_mask(shared_dim):
    torch.manual_seed(0)
    x, res = torch.ones(6, 5, 4), torch.zeros(6, 5, 4)
    out = bias_dropout_add(x, res, p=0.5, training=True, shared_dim=shared_dim)
    kept = out != 0
    assert torch.equal(kept, kept.narrow(shared_dim, 0, 1).expand_as(kept)), "mask must be shared along shared_dim"
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    torch.testing.assert_close(bias_dropout_add(x, res, 0.5, training=False, bias=torch.ones(4)), x + 1)
    with pytest.raises(ValueError, match="dropout p"):
        bias_dropout_add(x, res, 1.0, True)


def test_backend_selection_errors():
    assert get_ops_backend() is OpsBackend.TORCH
    with pytest.raises(ValueError, match="backend must be one of"):
        set_ops_backend("cuda-magic")


@pytest.mark.timeout(240)
def test_compiled_path_equals_torch_path():
    x, bias, mask = _inputs()
    w, b = torch.randn(7), torch.randn(7)
    eager = (softmax_with_biases(x, [bias, mask_bias(mask, 1e9)]), layer_norm(x, w, b), sigmoid_gate(x, bias))
    set_ops_backend("compile")
    try:
        compiled = (softmax_with_biases(x, [bias, mask_bias(mask, 1e9)]), layer_norm(x, w, b), sigmoid_gate(x, bias))
    finally:
        set_ops_backend("torch")
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["eager", "fused"])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_core_gradients_equal_eager_formula(masked, path, monkeypatch):
    """[Note: fused attention in inference], [Note: eager attention in training]: with autograd
    the training attention's gradients (eager: autograd's; fused: the probabilities recomputed in
    backward) equal autograd through the eager formula, for q, k, v, a pair bias broadcast over
    the batch and a key-mask bias (float64, 1e-10: only the summation order differs); the forward
    equals the forward without autograd inside ``training_kernels()`` bit for bit."""
    import fastfold.ops.attention
    from fastfold.ops import attention_core, training_kernels

    if path == "fused":
        monkeypatch.setattr(fastfold.ops.attention, "EAGER_TRAINING_MAX_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    pair = torch.randn(1, 2, 5, 5, generator=g, dtype=torch.float64)
    keys = (torch.rand(3, 1, 1, 5, generator=g) > (0.3 if masked else -1.0)).double()
    key_bias = mask_bias(keys, 1e9) + 0.1 * torch.randn(3, 1, 1, 5, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pair, key_bias)]
    out = attention_core(*leaves[:3], leaves[3:])
    with torch.no_grad(), training_kernels():
        assert torch.equal(out, attention_core(q, k, v, [pair, key_bias]))
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v, pair, key_bias)]
    want_out = torch.softmax(ref[0] @ ref[1].transpose(-1, -2) + ref[3] + ref[4], dim=-1) @ ref[2]
    want = torch.autograd.grad((want_out * w).sum(), ref)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["q", "k", "v", "pair bias", "key bias"], got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"gradient of {name}")


def test_attention_core_kernel_choice(monkeypatch):
    """[Note: eager attention in training]: inference (no autograd) runs the fused kernel at every
    size; a training forward (autograd, or no autograd inside ``training_kernels()``) runs the eager
    path while the logits fit ``EAGER_TRAINING_MAX_BYTES`` and the fused kernel above it. The
    choice is per thread: ``training_kernels()`` does not leak into another thread or past its block."""
    import contextlib
    import threading

    import fastfold.ops.attention as att
    from fastfold.ops import attention_core, training_kernels

    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    q, k, v = (torch.randn(2, 3, 4, 5) for _ in range(3))  # logits 2*3*4*4 float32 = 384 bytes

    def fused_used(grad, training=False, limit=att.EAGER_TRAINING_MAX_BYTES):
        monkeypatch.setattr(att, "EAGER_TRAINING_MAX_BYTES", limit)
        calls.clear()
        with torch.set_grad_enabled(grad), training_kernels() if training else contextlib.nullcontext():
            attention_core(q.clone().requires_grad_(grad), k, v)
        return bool(calls)

    assert fused_used(grad=False)
    assert not fused_used(grad=True)
    assert not fused_used(grad=False, training=True)
    assert not fused_used(grad=True, limit=384) and fused_used(grad=True, limit=383)
    assert fused_used(grad=False, training=True, limit=383)
    seen = []
    with training_kernels():
        other = threading.Thread(target=lambda: seen.append(fused_used(grad=False)))
        other.start()
        other.join()
    assert seen == [True] and fused_used(grad=False)
