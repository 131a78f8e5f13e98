"""3D on 8 ranks (q=2): every layer equals dense (both orientations of the linear), the
communication per layer equals the documented formula, parameters cost dense/P, and the small
GPT trains like dense.

Expected bytes, forward + backward, fp32, ``n = B*S/q^2`` tokens per rank (docs "3D"):
Linear(in, out): all_gather = reduce_scatter = ``n*in + n*out + out*in/q^2 + out/q + out/q^2``.
"""

import pytest
import torch
from test_colossal_tensor_parallel_gpt import _check_training
from torch import nn
from tp_testing import counted, param_bytes

from colossal.comm import CommCounter, Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import gpt_plan
from colossal.tensor_parallel import three_d as T3
from colossal.testkit import GPT, GPTConfig, assert_close

S, H, OUT, V = 8, 16, 32, 32
F32 = 4


def _split(t, g, orient):
    return T3.split_input_3d(t, g, orient)


def _other(orient):
    return "L1" if orient == "L0" else "L0"


def _linear(g, counter, b, orient):
    dense = nn.Linear(H, OUT)
    x = torch.randn(b, S, H, requires_grad=True)
    gy = torch.randn(b, S, OUT)
    y = dense(x)
    y.backward(gy)
    par = T3.Linear3D.from_dense(dense, g, orient)
    xp = _split(x.detach(), g, orient).clone().requires_grad_()
    yp, nbytes = counted(counter, lambda: (o := par(xp), o.backward(_split(gy, g, _other(orient))))[0])
    assert_close(yp, _split(y, g, _other(orient)), f"{orient} linear output")
    assert_close(T3.gather_output_3d(yp.detach(), g, _other(orient)), y, "gathered output")
    assert_close(xp.grad, _split(x.grad, g, orient), f"{orient} linear input grad")
    _, hi, _, si = g.axes(orient)
    blk = dense.weight.grad.chunk(g.q, 0)[si].chunk(g.q, 1)[hi].chunk(g.q, 0)[g.layout.input_index]
    assert_close(par.weight.grad, blk, f"{orient} linear weight grad")
    n = b * S // g.q**2
    side = (n * H + n * OUT + OUT * H // g.q**2 + OUT // g.q + OUT // g.q**2) * F32
    assert nbytes == {"all_gather": side, "reduce_scatter": side}, nbytes
    assert param_bytes(par) == (OUT * H + OUT) * F32 // g.q**3


def _layernorm(g, counter, b):
    dense = nn.LayerNorm(H)
    nn.init.normal_(dense.weight)
    nn.init.normal_(dense.bias)
    x = torch.randn(b, S, H, requires_grad=True)
    gy = torch.randn(b, S, H)
    y = dense(x)
    y.backward(gy)
    par = T3.LayerNorm3D.from_dense(dense, g)
    xp = _split(x.detach(), g, "L0").clone().requires_grad_()
    yp, nbytes = counted(counter, lambda: (o := par(xp), o.backward(_split(gy, g, "L0")))[0])
    assert_close(yp, _split(y, g, "L0"), "layernorm output")
    assert_close(xp.grad, _split(x.grad, g, "L0"), "layernorm input grad")
    a, bb, c = g.layout.input_index, g.layout.weight_index, g.layout.output_index
    for got, want in ((par.weight.grad, dense.weight.grad), (par.bias.grad, dense.bias.grad)):
        assert_close(got, want.chunk(g.q)[bb].chunk(g.q)[a].chunk(g.q)[c], "layernorm parameter grad")
    n = b * S // g.q**2
    vec = 2 * (H // g.q**2 + H // g.q) * F32
    assert nbytes == {"all_reduce": 4 * n * F32, "all_gather": vec, "reduce_scatter": vec}, nbytes
    assert param_bytes(par) == 2 * H * F32 // g.q**3


def _embeddings_head_loss(g, counter, b):
    dense = nn.Embedding(V, H)
    ids = torch.randint(0, V, (b, S))
    gy = torch.randn(b, S, H)
    dense(ids).backward(gy)
    n = b * S // g.q**2
    table = V * H // g.q**2
    a, bb, c = g.layout.input_index, g.layout.weight_index, g.layout.output_index
    vocab_blk = dense.weight.grad.chunk(g.q, 0)[c].chunk(g.q, 1)[bb].chunk(g.q, 0)[a]
    hidden_blk = dense.weight.grad.chunk(g.q, 1)[bb].chunk(g.q, 1)[a].chunk(g.q, 1)[c]
    for par, wgrad, expect in (
        (
            T3.Embedding3D(dense, g),
            hidden_blk,
            {"all_gather": table + V * H // g.q, "reduce_scatter": table + V * H // g.q},
        ),
        (
            T3.VocabParallelEmbedding3D(dense, g),
            vocab_blk,
            {"all_gather": table + n * H, "reduce_scatter": table + n * H},
        ),
    ):
        out, nbytes = counted(counter, lambda par=par: (o := par(ids), o.backward(_split(gy, g, "L0")))[0])
        name = type(par).__name__
        assert_close(out, _split(dense(ids), g, "L0"), f"{name} output")
        assert_close(par.weight.grad, wgrad, f"{name} weight grad")
        assert nbytes == {k: v * F32 for k, v in expect.items()}, (name, nbytes)
        assert param_bytes(par) == V * H * F32 // g.q**3
    head = nn.Linear(H, V, bias=False)
    x = torch.randn(b, S, H, requires_grad=True)
    tgt = torch.randint(0, V, (b, S))
    loss = nn.functional.cross_entropy(head(x).flatten(0, 1), tgt.flatten())
    loss.backward()
    par = T3.VocabParallelLMHead3D.from_dense(head, g)
    xp = _split(x.detach(), g, "L0").clone().requires_grad_()
    lp, nbytes = counted(counter, lambda: (ls := T3.cross_entropy_3d(par(xp), tgt, g), ls.backward())[0])
    assert_close(lp, loss, "3d vocab-parallel loss")
    assert_close(xp.grad, _split(x.grad, g, "L0"), "head input grad")
    head_blk = head.weight.grad.chunk(g.q, 0)[c].chunk(g.q, 1)[bb].chunk(g.q, 0)[a]
    assert_close(par.weight.grad, head_blk, "head weight grad")
    side = (n * H + table + n * V) * F32
    # max (n) + sums (2n); the mean's sum and row count (not ignore_index) over the batch group
    assert nbytes == {"all_gather": side, "reduce_scatter": side, "all_reduce": (3 * n + 2) * F32}, nbytes


def _all_3d():
    torch.manual_seed(0)
    mesh = Mesh(axes={"tp": 8})
    g = T3.Grid3D.of(mesh.layout("3d", "tp"))
    b = g.q**2
    with CommCounter() as counter:
        _linear(g, counter, b, "L0")
        _linear(g, counter, b, "L1")
        _layernorm(g, counter, b)
        _embeddings_head_loss(g, counter, b)
    _check_training(
        "3d", lambda m: T3.apply_3d(m, mesh, gpt_plan("3d")), lambda lg, t: T3.cross_entropy_3d(lg, t, g), 4
    )
    with pytest.raises(ValueError, match="3d tensor parallel needs a group size of q\\^3; got 4"):
        T3.apply_3d(GPT(GPTConfig()), Mesh(axes={"dp": 2, "tp": 4}))


def test_3d_layers_and_gpt_match_dense():
    run_distributed(_all_3d, 8, timeout=200)
