"""Each bad configuration raises ValueError on every rank, before any communication."""

import pytest
import torch
from pp_testing import TinyGPT, batch, gpt_embed, gpt_head, lm_loss
from torch import nn

from colossal.comm import CommCounter
from colossal.comm.testing import run_distributed
from colossal.pipeline import PipelineConfig, PipelineParallel


def _gpt():
    with torch.device("meta"):
        return TinyGPT()


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)


def _bad_build(cfg_kwargs, model_fn):
    return PipelineParallel(model_fn(), PipelineConfig(**cfg_kwargs), embed=gpt_embed, head=gpt_head)


BUILD = [
    ({"num_microbatches": 1, "schedule": "interleaved", "virtual": 2}, _gpt, "needs at least 2 micro-batches"),
    ({"num_microbatches": 4, "schedule": "interleaved", "virtual": 3}, _gpt, "not divisible by pp \\* v = 6"),
    ({"num_microbatches": 2}, NoBlocks, "looked for .*blocks, layers, h, transformer.h"),
    ({"num_microbatches": 2, "blocks": "body"}, NoBlocks, "blocks='body' .* found a Linear"),
    ({"num_microbatches": 2, "partition": "sizes", "sizes": [6, 3]}, _gpt, "summing to 8 blocks"),
]


def _rank():
    """Every bad configuration, in turn; returns the messages this rank raised."""
    import re

    msgs = []
    with CommCounter() as counter:
        for kwargs, model_fn, match in BUILD:
            with pytest.raises(ValueError, match=match) as e:
                _bad_build(kwargs, model_fn)
            msgs.append(str(e.value))
    assert counter.total_nbytes == 0 and not counter.events, counter.events  # nothing was sent
    pipe = PipelineParallel(_gpt(), PipelineConfig(num_microbatches=4), embed=gpt_embed, head=gpt_head)
    idx, tgt = batch(0, b=6)
    with CommCounter() as counter:
        with pytest.raises(
            ValueError, match=re.escape("batch of (6,) samples is not divisible into num_microbatches=4")
        ):
            pipe.step(idx, tgt, lm_loss)
        with pytest.raises(ValueError, match="targets must be a tensor with the batch's 8 rows"):
            pipe.step(batch(0)[0], tgt, lm_loss)
    assert not counter.events
    return msgs


def test_bad_configs_raise_on_every_rank():
    msgs = run_distributed(_rank, 2, timeout=120)
    assert msgs[0] == msgs[1] and len(msgs[0]) == len(BUILD)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_microbatches": 0}, "num_microbatches must be a positive int"),
        ({"num_microbatches": 2, "partition": "even"}, "partition must be"),
        ({"num_microbatches": 2, "sizes": [4, 4]}, "goes with partition='sizes'"),
        ({"num_microbatches": 2, "loss_reduction": "none"}, "loss_reduction must be"),
        ({"num_microbatches": 2, "p2p": "nccl"}, "p2p must be 'auto', 'overlap' or 'grouped', got 'nccl'"),
    ],
)
def test_bad_config_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)
