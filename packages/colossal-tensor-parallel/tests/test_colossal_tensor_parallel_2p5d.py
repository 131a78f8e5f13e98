"""2.5D (Tesseract) on 4 ranks (q=2, d=1) and 8 ranks (q=2, d=2): every layer equals dense with
the documented communication (weights replicated over depth: one extra all-reduce of the weight
gradient over ``dep``), and the small GPT trains like dense on 8 ranks."""

import pytest
import torch.distributed as dist
from test_colossal_tensor_parallel_gpt import _check_training
from tp_grid2d_checks import check_grid_layers

from colossal.comm import Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import apply_2p5d, cross_entropy_2p5d, gpt_plan, grid_2p5d
from colossal.testkit import GPT, GPTConfig


def _layers_and_gpt(depth):
    check_grid_layers("2.5d", depth)
    if depth > 1:
        mesh = Mesh(axes={"tp": -1})
        grid = grid_2p5d(mesh, "tp", depth)
        _check_training(
            "2.5d",
            lambda m: apply_2p5d(m, mesh, gpt_plan("2.5d"), depth=depth),
            lambda lg, t: cross_entropy_2p5d(lg, t, grid),
            batch=4,
            divisor=grid.q**2,  # weights replicated over depth: dense * d / P
        )
    with pytest.raises(ValueError, match="2.5d tensor parallel needs a group size of q\\^2\\*d; got 4 \\(depth d=2\\)"):
        apply_2p5d(GPT(GPTConfig()), Mesh(axes={"dp": dist.get_world_size() // 4, "tp": 4}), depth=2)


@pytest.mark.parametrize(("world", "depth"), [(4, 1), (8, 2)])
def test_2p5d_layers_and_gpt_match_dense(world, depth):
    run_distributed(_layers_and_gpt, world, depth, timeout=200)
