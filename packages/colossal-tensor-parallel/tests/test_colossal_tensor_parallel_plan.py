"""Plans: pattern resolution, clear errors, the GPT plan covers the reference GPT."""

import pytest

from colossal.tensor_parallel import Style, gpt_plan, parallelize, resolve_plan
from colossal.testkit import GPT, GPTConfig


def test_gpt_plan_resolves_every_pattern_on_the_reference_gpt():
    model = GPT(GPTConfig(n_layer=2))
    hits = resolve_plan(model, gpt_plan("2d"))
    names = {name for name, _, _ in hits}
    assert {"wte", "lm_head", "blocks.1.attn.q_proj", "blocks.0.mlp.fc_out", "ln_f"} <= names
    assert dict((n, s) for n, _, s in hits)["blocks.0.attn"] == Style.HEADS
    assert {n for n, _, _ in resolve_plan(model, gpt_plan("sequence"))} == {"wpe", "blocks.0.attn", "blocks.1.attn"}


def test_plan_errors_name_the_problem():
    model = GPT(GPTConfig(n_layer=1))
    with pytest.raises(ValueError, match="match no module"):
        resolve_plan(model, {"blocks.*.nothing": Style.COL})
    with pytest.raises(ValueError, match="matches several plan patterns"):
        resolve_plan(model, {"blocks.0.*proj": Style.COL, "blocks.0.attn.q_*": Style.COL})
    with pytest.raises(ValueError, match="is not a valid Style"):
        resolve_plan(model, {"wte": "sideways"})
    with pytest.raises(NotImplementedError, match="supported: '1d', '2d', '2.5d', '3d', 'sequence'"):
        gpt_plan("4d")
    with pytest.raises(NotImplementedError, match="supported"):
        parallelize(model, "4d", None)


def _convert_keeps_dtype():
    import torch
    import torch.distributed as dist

    model = GPT(GPTConfig(n_layer=1)).to(torch.float64)
    parallelize(model, "1d", dist.group.WORLD)
    return sorted({str(p.dtype) for p in model.parameters()} | {p.device.type for p in model.parameters()})


def test_converted_layers_keep_the_dense_models_dtype_and_device():
    """The parallel layers allocate their shards as float32 CPU tensors: a float64 (or bf16, or
    CUDA) model must come out of the conversion as it went in (on CUDA, an embedding left on the CPU
    failed at the first forward)."""
    from colossal.comm.testing import run_distributed

    assert run_distributed(_convert_keeps_dtype, 1) == [["cpu", "torch.float64"]]
