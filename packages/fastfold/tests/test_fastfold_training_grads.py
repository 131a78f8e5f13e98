"""Training gradients (the autograd path: eager attention with in-place biases, the outer product
mean in either contraction order, per-block activation checkpointing) equal those of the float64
references of the supplementary algorithms differentiated by autograd. Tolerance 1e-9: float64
on both sides, only the summation order differs."""

import pytest
import torch
from fastfold_testutils import rand, rand_mask, randomize_, ref_evoformer_block, tiny_evo

import fastfold.ops.attention
from fastfold import EvoformerStack
from fastfold.ops import training_kernels

TOL = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture(params=["eager", "fused"])
def attention_path(request, monkeypatch):
    """Training attention on the eager path (these sizes, the default) or on ``_FusedAttention``
    (what large crops take; see [Note: eager attention in training])."""
    if request.param == "fused":
        monkeypatch.setattr(fastfold.ops.attention, "EAGER_TRAINING_MAX_BYTES", 0)
    return request.param


def _loss(m, z, s):
    w = [rand(*t.shape, seed=20 + i) for i, t in enumerate((m, z, s))]  # weighted: no symmetric cancellation
    return sum((t * wi).sum() for t, wi in zip((m, z, s), w))


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("n_seq", [2, 6])  # c_hidden_opm 3: b-first (2 < 3) and outer-first contraction
def test_evoformer_gradients_equal_reference(checkpoint, n_seq, attention_path):
    stack = randomize_(EvoformerStack(tiny_evo(msa_dropout=0.0, pair_dropout=0.0)).double()).train()
    m, z = rand(n_seq, 7, 12, seed=1).requires_grad_(), rand(7, 7, 8, seed=2).requires_grad_()
    msa_mask, pair_mask = rand_mask(n_seq, 7, seed=3), rand_mask(7, 7, seed=4)
    _loss(*stack(m, z, msa_mask, pair_mask, checkpoint=checkpoint)).backward()
    got = [m.grad.clone(), z.grad.clone()] + [p.grad.clone() for p in stack.parameters()]
    m.grad = z.grad = None
    stack.zero_grad(set_to_none=True)
    m_ref, z_ref = m, z
    for block in stack.blocks:
        m_ref, z_ref = ref_evoformer_block(block, m_ref, z_ref, msa_mask, pair_mask)
    s_ref = m_ref[0] @ stack.linear.weight.T + stack.linear.bias
    _loss(m_ref, z_ref, s_ref).backward()
    want = [m.grad, z.grad] + [p.grad for p in stack.parameters()]
    names = ["m", "z"] + [n for n, _ in stack.named_parameters()]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, **TOL, msg=f"gradient of {name}")


def test_checkpointed_forward_runs_without_autograd_and_keeps_parameter_gradients():
    """[Note: checkpointing with the inference forward]: the checkpointed block's first forward runs
    without autograd (the inference paths) and only its recompute in backward with it; parameter
    gradients flow when the inputs need none (also through ``torch.autograd.grad``) and equal
    those of the plain autograd run (float64)."""
    stack = randomize_(EvoformerStack(tiny_evo(msa_dropout=0.0, pair_dropout=0.0)).double()).train()
    m, z = rand(3, 7, 12, seed=1), rand(7, 7, 8, seed=2)  # no requires_grad: params only
    msa_mask, pair_mask = rand_mask(3, 7, seed=3), rand_mask(7, 7, seed=4)
    seen = []
    hook = stack.blocks[0].pair_stack.tri_att_start.register_forward_pre_hook(
        lambda mod, args: seen.append(torch.is_grad_enabled())
    )
    params = list(stack.parameters())
    got = torch.autograd.grad(_loss(*stack(m, z, msa_mask, pair_mask, checkpoint=True)), params)
    hook.remove()
    assert seen == [False, True]  # forward without autograd, recompute with it
    want = torch.autograd.grad(_loss(*stack(m, z, msa_mask, pair_mask)), params)
    for (name, _), g, w in zip(stack.named_parameters(), got, want):
        torch.testing.assert_close(g, w, **TOL, msg=f"gradient of {name}")


@pytest.mark.parametrize("n_res", [7, 10])
def test_checkpointed_gradients_equal_plain_float32_bitwise(n_res, attention_path):
    """[Note: checkpointing with the inference forward]: the first forward (no autograd, inside
    ``training_kernels()``) and the recompute run the same kernels on the same layouts (the eager
    or the fused attention, the lean triangle update, the gates), so in float32 the checkpointed
    block's outputs and every gradient equal the plain autograd run's bit for bit (they differed
    by rounding when the two forwards took different kernels, up to 6.5e-5 of the largest
    gradient at a ReLU kink)."""
    f32 = torch.float32
    stack = randomize_(EvoformerStack(tiny_evo(msa_dropout=0.0, pair_dropout=0.0)).to(f32)).train()
    m, z = rand(3, n_res, 12, seed=1, dtype=f32), rand(n_res, n_res, 8, seed=2, dtype=f32)
    msa_mask, pair_mask = rand_mask(3, n_res, seed=3, dtype=f32), rand_mask(n_res, n_res, seed=4, dtype=f32)
    with torch.no_grad(), training_kernels():
        first = stack.blocks[0](m, z, msa_mask, pair_mask)
    plain = stack.blocks[0](m, z, msa_mask, pair_mask)
    for a, b in zip(first, plain):
        assert torch.equal(a, b), (a - b).abs().max()
    m, z = m.requires_grad_(), z.requires_grad_()
    wrt = [m, z, *stack.parameters()]
    got = torch.autograd.grad(_loss(*stack(m, z, msa_mask, pair_mask, checkpoint=True)), wrt)
    want = torch.autograd.grad(_loss(*stack(m, z, msa_mask, pair_mask)), wrt)
    names = ["m", "z"] + [n for n, _ in stack.named_parameters()]
    for name, g, w in zip(names, got, want):
        assert torch.equal(g, w), f"gradient of {name}: {(g - w).abs().max().item():.3g}"


@pytest.mark.parametrize("outgoing", [True, False])
def test_batched_triangle_update_equal_with_and_without_autograd_bitwise(outgoing):
    """With batch dims (the template stack's templates) the no-grad forward of a checkpointed block
    and its recompute agree bit for bit: the channels-first projection is one explicit ``baddbmm``
    in both modes (``torch.matmul``'s broadcasting path may depend on autograd; it did for the outer
    product mean's batched GEMM)."""
    from fastfold.model import TriangleMultiplicationIncoming, TriangleMultiplicationOutgoing

    cls = TriangleMultiplicationOutgoing if outgoing else TriangleMultiplicationIncoming
    mod = randomize_(cls(8, 5))
    z, mask = rand(3, 7, 7, 8, seed=1, dtype=torch.float32), rand_mask(3, 7, 7, seed=2, dtype=torch.float32)
    with torch.no_grad():
        first = mod(z, mask)
    assert torch.equal(first, mod(z.clone().requires_grad_(), mask))


def test_checkpointed_unused_output_leaves_gradients_none():
    """A loss on ``s`` alone: the last block's outer product mean and pair stack never reach it, so
    their parameters keep ``grad is None`` with checkpointing as in a plain run (the checkpoint no
    longer feeds a zero gradient for the unused ``z``), and every other gradient equals the plain
    run's bit for bit."""
    stack = randomize_(EvoformerStack(tiny_evo(msa_dropout=0.0, pair_dropout=0.0)).float()).train()
    m, z = rand(3, 7, 12, seed=1, dtype=torch.float32), rand(7, 7, 8, seed=2, dtype=torch.float32)
    grads = {}
    for checkpoint in (True, False):
        stack.zero_grad(set_to_none=True)
        stack(m, z, checkpoint=checkpoint)[2].pow(2).sum().backward()
        grads[checkpoint] = {n: p.grad for n, p in stack.named_parameters()}
    unused = [n for n, g in grads[False].items() if g is None]
    assert unused and all(n.startswith(("blocks.1.pair_stack.", "blocks.1.outer_product_mean.")) for n in unused)
    for n, g in grads[True].items():
        want = grads[False][n]
        assert (g is None) == (want is None), n
        assert want is None or torch.equal(g, want), n
