"""Layer checks shared by the 2D and 2.5D tests (rank functions; import from test files).

Expected communication per layer, forward + backward, fp32 bytes (docs "2D" and "2.5D"), with
``q`` the grid side, ``d`` the depth, ``n = B/(q*d) * S`` tokens per rank:
Linear(in, out): all_gather and reduce_scatter each ``n*in + out*in/q + out/q``;
all_reduce over ``dep`` (d > 1) ``out*in/q^2 + out/q^2``.
"""

import torch
from torch import nn
from tp_testing import counted, param_bytes

from colossal.comm import CommCounter, Mesh
from colossal.tensor_parallel import two_d as T2
from colossal.testkit import assert_close

S, H, OUT, V = 8, 16, 32, 32
F32 = 4


def _blk(t, g, dims, idx):
    return t.chunk(g.q, dims[0])[idx[0]].chunk(g.q, dims[1])[idx[1]]


def _vec(v, g):
    return v.chunk(g.q)[g.j].chunk(g.q)[g.i]


def _dep(nbytes, g):
    return {"all_reduce": nbytes} if g.depth > 1 else {}


def _linear(g, counter, b):
    dense = nn.Linear(H, OUT)
    x = torch.randn(b, S, H, requires_grad=True)
    gy = torch.randn(b, S, OUT)
    y = dense(x)
    y.backward(gy)
    par = T2.Linear2D.from_dense(dense, g)
    xp = T2.split_input_2d(x.detach(), g).clone().requires_grad_()
    yp, nbytes = counted(counter, lambda: (o := par(xp), o.backward(T2.split_input_2d(gy, g)))[0])
    assert_close(yp, T2.split_input_2d(y, g), "linear output")
    assert_close(T2.gather_output_2d(yp.detach(), g), y, "gathered linear output")
    assert_close(xp.grad, T2.split_input_2d(x.grad, g), "linear input grad")
    assert_close(par.weight.grad, _blk(dense.weight.grad, g, (0, 1), (g.j, g.i)), "linear weight grad")
    assert_close(par.bias.grad, _vec(dense.bias.grad, g), "linear bias grad")
    n = b // (g.q * g.depth) * S
    side = (n * H + OUT * H // g.q + OUT // g.q) * F32
    assert nbytes == {"all_gather": side, "reduce_scatter": side, **_dep((OUT * H + OUT) // g.q**2 * F32, g)}, nbytes
    assert param_bytes(par) == (OUT * H + OUT) * F32 // g.q**2


def _layernorm(g, counter, b):
    dense = nn.LayerNorm(H)
    nn.init.normal_(dense.weight)
    nn.init.normal_(dense.bias)
    x = torch.randn(b, S, H, requires_grad=True)
    gy = torch.randn(b, S, H)
    y = dense(x)
    y.backward(gy)
    par = T2.LayerNorm2D.from_dense(dense, g)
    xp = T2.split_input_2d(x.detach(), g).clone().requires_grad_()
    yp, nbytes = counted(counter, lambda: (o := par(xp), o.backward(T2.split_input_2d(gy, g)))[0])
    assert_close(yp, T2.split_input_2d(y, g), "layernorm output")
    assert_close(xp.grad, T2.split_input_2d(x.grad, g), "layernorm input grad")
    assert_close(par.weight.grad, _vec(dense.weight.grad, g), "layernorm weight grad")
    assert_close(par.bias.grad, _vec(dense.bias.grad, g), "layernorm bias grad")
    n = b // (g.q * g.depth) * S
    vec = 2 * H // g.q * F32
    expect = {"all_reduce": 4 * n * F32 + (2 * H // g.q**2 * F32 if g.depth > 1 else 0)}
    assert nbytes == {**expect, "all_gather": vec, "reduce_scatter": vec}, nbytes


def _embeddings(g, counter, b):
    dense = nn.Embedding(V, H)
    ids = torch.randint(0, V, (b, S))
    gy = torch.randn(b, S, H)
    dense(ids).backward(gy)
    n = b // (g.q * g.depth) * S
    table = V * H // g.q  # the gathered (V, H/q) weight
    for par, wblk, expect in (
        (T2.Embedding2D(dense, g), (1, 1, g.j, g.i), {"all_gather": table, "reduce_scatter": table}),
        (T2.VocabParallelEmbedding2D(dense, g), (0, 1, g.i, g.j), {"reduce_scatter": n * g.q * H // g.q}),
    ):
        expect = {k: v * F32 for k, v in expect.items()}
        if "all_gather" not in expect:
            expect["all_gather"] = expect["reduce_scatter"]
        expect.update(_dep(V * H // g.q**2 * F32, g))
        out, nbytes = counted(counter, lambda par=par: (o := par(ids), o.backward(T2.split_input_2d(gy, g)))[0])
        name = type(par).__name__
        assert_close(out, T2.split_input_2d(dense(ids), g), f"{name} output")
        assert_close(par.weight.grad, _blk(dense.weight.grad, g, wblk[:2], wblk[2:]), f"{name} weight grad")
        assert nbytes == expect, (name, nbytes)
        assert param_bytes(par) == V * H * F32 // g.q**2
    pos = T2.Embedding2D(dense, g, split_rows=False)
    assert_close(pos(torch.arange(S)), dense(torch.arange(S)).chunk(g.q, -1)[g.j], "position embedding")


def _head_and_loss(g, counter, b):
    head = nn.Linear(H, V, bias=False)
    x = torch.randn(b, S, H, requires_grad=True)
    tgt = torch.randint(0, V, (b, S))
    loss = nn.functional.cross_entropy(head(x).flatten(0, 1), tgt.flatten())
    loss.backward()
    par = T2.VocabParallelLMHead2D.from_dense(head, g)
    xp = T2.split_input_2d(x.detach(), g).clone().requires_grad_()
    lp, nbytes = counted(counter, lambda: (ls := T2.cross_entropy_2d(par(xp), tgt, g), ls.backward())[0])
    assert_close(lp, loss, "2d vocab-parallel loss")
    assert_close(xp.grad, T2.split_input_2d(x.grad, g), "head input grad")
    assert_close(par.weight.grad, _blk(head.weight.grad, g, (0, 1), (g.i, g.j)), "head weight grad")
    n = b // (g.q * g.depth) * S
    side = (V * H // g.q + n * V) * F32
    # max (n) + sums (2n) over row; the mean's sum and row count (not ignore_index) over the batch group
    loss_bytes = (3 * n + 2) * F32
    expect = {
        "all_gather": side,
        "reduce_scatter": side,
        "all_reduce": loss_bytes + (V * H // g.q**2 * F32 if g.depth > 1 else 0),
    }
    assert nbytes == expect, nbytes


def check_grid_layers(kind, depth):
    """Every 2D layer against dense on this rank's grid (``kind`` ``"2d"`` or ``"2.5d"``)."""
    torch.manual_seed(0)
    mesh = Mesh(axes={"tp": -1})
    g = T2.Grid2D.of(mesh.layout(kind, "tp", depth=depth) if kind == "2.5d" else mesh.layout("2d", "tp"))
    b = g.q * g.depth
    with CommCounter() as counter:
        for check in (_linear, _layernorm, _embeddings, _head_and_loss):
            check(g, counter, b)
