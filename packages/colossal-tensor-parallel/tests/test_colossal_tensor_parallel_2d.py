"""2D (SUMMA) layers on 4 ranks: forward and gradients equal dense, communication per layer
equals the documented formula, parameters cost dense/P; shapes are validated with clear errors."""

import copy

import pytest
import torch
import torch.distributed as dist
from tp_grid2d_checks import check_grid_layers

from colossal.comm import CommCounter, Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import Grid2D, apply_2d, gpt_plan, split_input_2d
from colossal.testkit import GPT, Block, GPTConfig, assert_close


def test_2d_layers_match_dense():
    run_distributed(check_grid_layers, 4, "2d", 1, timeout=120)


def _block():
    """A whole GPT block: parity, and the documented block total (one input gather for q, k, v)."""
    torch.manual_seed(0)
    mesh = Mesh(axes={"tp": 4})
    grid = Grid2D.of(mesh.layout("2d", "tp"))
    b, s, c = 2, 8, 16
    dense = Block(GPTConfig(n_embd=c, n_head=4))
    x = torch.randn(b, s, c, requires_grad=True)
    g = torch.randn(b, s, c)
    dense(x).backward(g)
    block_plan = {k.removeprefix("blocks.*."): v for k, v in gpt_plan("2d").items() if "*" in k}
    par = apply_2d(copy.deepcopy(dense), mesh, block_plan)
    xp = split_input_2d(x.detach(), grid).clone().requires_grad_()
    with CommCounter() as counter:
        out = par(xp)
        out.backward(split_input_2d(g, grid))
    assert_close(out, split_input_2d(dense(x), grid), "2d block output")
    assert_close(xp.grad, split_input_2d(x.grad, grid), "2d block input grad")
    n, q = b * s // 2, 2
    side = (7 * n * c + 12 * c * c // q + 9 * c // q + 4 * c // q) * 4  # docs "2D": a GPT block
    assert dict(counter.nbytes) == {"all_gather": side, "reduce_scatter": side, "all_reduce": 8 * n * 4}


def test_2d_block_matches_dense():
    run_distributed(_block, 4, timeout=120)


def _errors():
    with pytest.raises(ValueError, match="2d tensor parallel needs a group size of q\\^2; got 2"):
        apply_2d(GPT(GPTConfig()), Mesh(axes={"dp": 2, "tp": 2}))
    if dist.get_world_size() == 4:
        with pytest.raises(ValueError, match="n_head=3 must be divisible by the 2d head shards=2"):
            apply_2d(GPT(GPTConfig(n_embd=24, n_head=3)), Mesh(axes={"tp": 4}))
        with pytest.raises(ValueError, match="num_embeddings \\(vocabulary\\)=31 must be divisible"):
            apply_2d(GPT(GPTConfig(vocab_size=31)), Mesh(axes={"tp": 4}))


def test_2d_validation_names_values():
    run_distributed(_errors, 4, timeout=60)
