"""Sequence parallel attention (ring and all-to-all), causal and not: outputs and q/k/v
gradients equal dense attention on 2 and 4 ranks; communication equals the documented formula."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tp_testing import counted

from colossal.comm import CommCounter
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import sequence as S
from colossal.testkit import CausalSelfAttention, GPTConfig, assert_close

B, HEADS, T, D = 2, 4, 8, 4
F32 = 4


def _attention(p):
    torch.manual_seed(0)
    group, r = dist.group.WORLD, dist.get_rank()
    t = T // p
    block = B * HEADS * t * D * F32  # bytes of one rank's q (or k, v, out) chunk
    expected = {  # docs "Sequence parallel": forward + backward
        S.ring_attention: {"ring_exchange": 2 * 2 * (p - 1) * block},
        S.all_to_all_attention: {"all_to_all": 2 * 4 * block},
    }
    with CommCounter() as counter:
        for causal in (True, False):
            q, k, v = (torch.randn(B, HEADS, T, D, requires_grad=True) for _ in range(3))
            g = torch.randn(B, HEADS, T, D)
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
            want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for fn in (S.ring_attention, S.all_to_all_attention):
                parts = [x.detach().chunk(p, dim=2)[r].clone().requires_grad_() for x in (q, k, v)]

                def step(fn=fn, parts=parts, causal=causal, g=g):
                    out = fn(*parts, group, causal=causal)
                    out.backward(g.chunk(p, dim=2)[r])
                    return out

                out, nbytes = counted(counter, step)
                name = f"{fn.__name__} causal={causal}"
                assert_close(out, want.chunk(p, dim=2)[r], f"{name} output")
                for x, part in zip((q, k, v), parts):
                    assert_close(part.grad, x.grad.chunk(p, dim=2)[r], f"{name} grad")
                assert nbytes == expected[fn], (name, nbytes)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_attention_matches_dense(world):
    run_distributed(_attention, world, world, timeout=90)


def _module_and_errors(kind):
    torch.manual_seed(0)
    group, r, p = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    dense = CausalSelfAttention(GPTConfig(n_embd=16, n_head=4))
    x = torch.randn(B, T, 16, requires_grad=True)
    dense(x).sum().backward()
    par = S.SequenceParallelAttention.from_dense(dense, group, kind)
    xp = S.split_sequence(x.detach(), group).requires_grad_()
    out = par(xp)
    assert_close(S.gather_sequence(out, group), dense(x), f"{kind} module output")
    out.sum().backward()
    assert_close(xp.grad, x.grad.chunk(p, dim=1)[r], f"{kind} module input grad")
    with pytest.raises(ValueError, match="sequence length=6 must be divisible by the sequence group size=4"):
        S.split_sequence(torch.zeros(2, 6), group)
    if kind == "all_to_all":
        with pytest.raises(ValueError, match="n_head=3 must be divisible by the sequence group size=4"):
            S.SequenceParallelAttention(CausalSelfAttention(GPTConfig(n_embd=12, n_head=3)), group, kind)


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_sequence_attention_module(kind):
    run_distributed(_module_and_errors, 4, kind, timeout=90)


def _masked_and_bidirectional():
    torch.manual_seed(0)
    group, r, p = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    key_mask = torch.rand(B, T) > 0.3
    key_mask[:, 0] = True  # every query has a key to attend (as a real padded batch does)
    for causal in (True, False):
        q, k, v = (torch.randn(B, HEADS, T, D, requires_grad=True) for _ in range(3))
        g = torch.randn(B, HEADS, T, D)
        allowed = key_mask[:, None, None, :] & (torch.ones(T, T).tril().bool() if causal else torch.ones(T, T).bool())
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3)
        want.backward(g)
        for fn in (S.ring_attention, S.all_to_all_attention):
            parts = [x.detach().chunk(p, dim=2)[r].clone().requires_grad_() for x in (q, k, v)]
            out = fn(*parts, group, causal=causal, scale=0.3, key_mask=key_mask)
            out.backward(g.chunk(p, dim=2)[r])
            name = f"{fn.__name__} causal={causal} masked"
            assert_close(out, want.chunk(p, dim=2)[r], f"{name} output")
            for x, part in zip((q, k, v), parts):
                assert_close(part.grad, x.grad.chunk(p, dim=2)[r], f"{name} grad")
    # a bidirectional attention module stays bidirectional
    dense = CausalSelfAttention(GPTConfig(n_embd=16, n_head=4))
    dense.is_causal = False
    x = torch.randn(B, T, 16)
    b, t, c = x.shape
    q, k, v = (proj(x).view(b, t, 4, -1).transpose(1, 2) for proj in (dense.q_proj, dense.k_proj, dense.v_proj))
    want = dense.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
    par = S.SequenceParallelAttention.from_dense(dense, group, "ring")
    assert_close(S.gather_sequence(par(S.split_sequence(x, group)), group), want, "bidirectional module")
    del dense.is_causal  # nothing says causal or not: refused, naming what it needs
    with pytest.raises(TypeError, match=r"lacks \['is_causal \(bool\)'\]"):
        S.SequenceParallelAttention.from_dense(dense, group, "ring")


def test_sequence_attention_padding_mask_and_bidirectional():
    run_distributed(_masked_and_bidirectional, 2, timeout=90)


def _blocked_online_softmax():
    torch.manual_seed(1)
    group, r, p = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    n = 32  # t = 16 tokens per rank, in key blocks of 3 (uneven last block); T > 2d
    S.RING_BLOCK = 3
    key_mask = torch.rand(B, n) > 0.4
    key_mask[0, :] = False  # a row with nothing to attend: the uniform average, as the dense path
    key_mask[1, 0] = True
    for causal in (True, False):
        q, k, v = (torch.randn(B, HEADS, n, D, requires_grad=True) for _ in range(3))
        g = torch.randn(B, HEADS, n, D)
        scores = (q @ k.transpose(-1, -2)) * 0.5
        want = S._mask_scores(scores, 0, causal, key_mask).softmax(-1) @ v  # the paper's form, dense
        want.backward(g)
        parts = [x.detach().chunk(p, dim=2)[r].clone().requires_grad_() for x in (q, k, v)]
        saved = []

        def pack(x, saved=saved):
            saved.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = S.ring_attention(*parts, group, causal=causal, scale=0.5, key_mask=key_mask)
        out.backward(g.chunk(p, dim=2)[r])
        name = f"blocked causal={causal}"
        assert_close(out, want.chunk(p, dim=2)[r], f"{name} output")
        for x, part in zip((q, k, v), parts):
            assert_close(part.grad, x.grad.chunk(p, dim=2)[r], f"{name} grad")
        # nothing of the (B, h, t, T) score rows is kept for backward: memory linear in T
        assert max(saved) < B * HEADS * (n // p) * n, (name, saved)


def test_ring_attention_online_softmax_blocks_and_linear_memory():
    run_distributed(_blocked_online_softmax, 2, timeout=90)
