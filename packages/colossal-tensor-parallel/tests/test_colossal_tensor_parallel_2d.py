"""2D (SUMMA) layers on 4 ranks: forward and gradients equal dense, communication per layer
equals the documented formula, parameters cost dense/P; shapes are validated with clear errors."""

import pytest
import torch.distributed as dist
from tp_gpt_reference import GPT, GPTConfig
from tp_grid2d_checks import check_grid_layers

from colossal.comm import Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import apply_2d


def test_2d_layers_match_dense():
    run_distributed(check_grid_layers, 4, "2d", 1, timeout=120)


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
