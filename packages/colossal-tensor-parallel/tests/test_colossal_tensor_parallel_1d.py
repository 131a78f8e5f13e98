"""1D (Megatron) layers: forward and gradients equal the dense layer on 2 and 4 ranks, the
communication per layer equals the documented formula, and parameters are split by P."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from tp_testing import counted, param_bytes

from colossal.comm import CommCounter
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import apply_1d, gpt_plan
from colossal.tensor_parallel import one_d as T
from colossal.testkit import Block, GPTConfig, assert_close

B, S, H, OUT, V = 2, 8, 16, 32, 32
N = B * S
F32 = 4


def _chunk(t, dim, p, r):
    return t.chunk(p, dim=dim)[r]


def _run_linear(style, counter, p, r, group):
    dense = nn.Linear(H, OUT)
    x = torch.randn(B, S, H, requires_grad=True)
    y = dense(x)
    y.backward(torch.ones_like(y) * torch.arange(OUT))
    par = T.Linear1D.from_dense(dense, group, style)
    xp = (x.detach() if style == "col" else _chunk(x.detach(), -1, p, r)).clone().requires_grad_()
    grad = torch.ones(B, S, OUT) * torch.arange(OUT)

    def step():
        yp = par(xp)
        yp.backward(grad if style == "row" else _chunk(grad, -1, p, r))
        return yp

    yp, nbytes = counted(counter, step)
    wdim = 0 if style == "col" else 1
    assert_close(yp, y if style == "row" else _chunk(y, -1, p, r), f"{style} output")
    assert_close(xp.grad, x.grad if style == "col" else _chunk(x.grad, -1, p, r), f"{style} input grad")
    assert_close(par.weight.grad, _chunk(dense.weight.grad, wdim, p, r), f"{style} weight grad")
    assert_close(par.bias.grad, dense.bias.grad if style == "row" else _chunk(dense.bias.grad, 0, p, r), "bias grad")
    # docs "1D": col = one all-reduce of dX (N*in) backward; row = one all-reduce of Y (N*out) forward
    assert nbytes == {"all_reduce": N * (H if style == "col" else OUT) * F32}, nbytes
    w_bytes = OUT * H * F32 // p + OUT * F32 // (p if style == "col" else 1)
    assert param_bytes(par) == w_bytes


def _run_embeddings(counter, p, r, group):
    dense = nn.Embedding(V, H)
    ids = torch.randint(0, V, (B, S))
    g = torch.randn(B, S, H)
    dense(ids).backward(g)
    for cls, dim, expect in (
        (T.VocabParallelEmbedding1D, 0, {"all_reduce": N * H * F32}),  # forward all-reduce of (N, H)
        (T.Embedding1D, 1, {"all_gather": N * H * F32}),  # forward all-gather into (N, H)
    ):
        par = cls.from_dense(dense, group)
        out, nbytes = counted(counter, lambda par=par: (o := par(ids), o.backward(g))[0])
        assert_close(out, dense(ids), f"{cls.__name__} output")
        assert_close(par.weight.grad, _chunk(dense.weight.grad, dim, p, r), f"{cls.__name__} weight grad")
        assert nbytes == expect, (cls.__name__, nbytes)
        assert param_bytes(par) == V * H * F32 // p


def _run_head_and_loss(counter, p, r, group):
    head = nn.Linear(H, V, bias=False)
    x = torch.randn(B, S, H, requires_grad=True)
    tgt = torch.randint(0, V, (B, S))
    loss = nn.functional.cross_entropy(head(x).flatten(0, 1), tgt.flatten())
    loss.backward()
    par = T.VocabParallelLMHead1D.from_dense(head, group)
    xp = x.detach().clone().requires_grad_()

    def step():
        lp = T.cross_entropy_1d(par(xp), tgt, group)
        lp.backward()
        return lp

    lp, nbytes = counted(counter, step)
    assert_close(lp, loss, "vocab-parallel loss")
    assert_close(xp.grad, x.grad, "head input grad")
    assert_close(par.weight.grad, _chunk(head.weight.grad, 0, p, r), "head weight grad")
    # loss: all-reduce max (N) + all-reduce (2N); head backward: all-reduce dX (N*H)
    assert nbytes == {"all_reduce": (N + 2 * N + N * H) * F32}, nbytes
    ln = nn.LayerNorm(H)
    assert_close(T.LayerNorm1D.from_dense(ln)(x), ln(x), "LayerNorm1D")


def _block(counter, p, group):
    """A whole GPT block: parity, and Megatron's 2 all-reduces forward + 2 backward of (N, C)."""
    dense = Block(GPTConfig(n_embd=H, n_head=4))
    x = torch.randn(B, S, H, requires_grad=True)
    g = torch.randn(B, S, H)
    dense(x).backward(g)
    par = apply_1d(
        copy.deepcopy(dense), group, {k.removeprefix("blocks.*."): v for k, v in gpt_plan().items() if "*" in k}
    )
    xp = x.detach().clone().requires_grad_()
    out, nbytes = counted(counter, lambda: (o := par(xp), o.backward(g))[0])
    assert_close(out, dense(x), "block output")
    assert_close(xp.grad, x.grad, "block input grad")
    assert_close(par.mlp.fc_in.weight.grad, _chunk(dense.mlp.fc_in.weight.grad, 0, p, dist.get_rank()), "fc_in grad")
    assert nbytes == {"all_reduce": 4 * N * H * F32}, nbytes


def _layers(p):
    torch.manual_seed(0)
    group, r = dist.group.WORLD, dist.get_rank()
    with CommCounter() as counter:
        _run_linear("col", counter, p, r, group)
        _run_linear("row", counter, p, r, group)
        _run_embeddings(counter, p, r, group)
        _run_head_and_loss(counter, p, r, group)
        _block(counter, p, group)
        x = torch.randn(B, S, H, requires_grad=True)
        part = T.split_input_1d(x, group)
        assert_close(T.gather_output_1d(part, group), x, "split then gather")


@pytest.mark.parametrize("world", [2, 4])
def test_1d_layers_match_dense(world):
    run_distributed(_layers, world, world, timeout=90)


def _bad_shapes():
    with pytest.raises(ValueError, match="out_features=30 must be divisible by the 1D group size=4"):
        T.Linear1D(16, 30, dist.group.WORLD, "col")
    with pytest.raises(ValueError, match="num_embeddings"):
        T.VocabParallelEmbedding1D(30, 16, dist.group.WORLD)


def test_1d_validation_names_values():
    run_distributed(_bad_shapes, 4, timeout=60)
