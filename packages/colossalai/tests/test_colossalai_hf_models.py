"""Hugging Face ``transformers`` models (GPT-2, Llama, BERT, ViT, and Mixtral under the hybrid
plugin; tiny random configs built
locally) under every plugin: DDP, FSDP, ZeRO 1/2/3, Gemini, and the hybrid plugin's built-in
policies (tp=2, sp=2 with padding masks, tp x dp and tp x sp on 4 ranks), each trained 3 steps with
AdamW against the same model trained by plain PyTorch.

Tolerance: fp32, 1e-5 relative per-step loss. Every plugin computes the same sums in another
order (tensor-parallel partial products, ring attention chunks, gradient averages over ranks);
measured differences are at most 2 ulp (~2.4e-7 absolute on losses near 4).

The GPT-2 tensor-parallel model's full state dict is the Hugging Face one (names, dense shapes,
values), so checkpoints stay loadable by ``transformers``.

One spawn per world size runs every (family, plugin) case in sequence and reports each case's
losses or error, so one failure does not hide the others.
"""

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import FAMILIES, batches, build, loss  # noqa: E402
from plan_harness import boosted_losses, dense_losses  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import Booster, GeminiPlugin, HybridParallelPlugin, TorchDDPPlugin, TorchFSDPPlugin, ZeroPlugin  # noqa: E402

PLUGINS = {
    2: {
        "ddp": TorchDDPPlugin,
        "fsdp": TorchFSDPPlugin,
        "zero1": lambda: ZeroPlugin(stage=1),
        "zero2": lambda: ZeroPlugin(stage=2),
        "zero3": lambda: ZeroPlugin(stage=3),
        "gemini": GeminiPlugin,
        "tp2": lambda: HybridParallelPlugin(tp_size=2),
        "sp2-ring": lambda: HybridParallelPlugin(tp_size=1, sp_size=2),
        "sp2-all_to_all": lambda: HybridParallelPlugin(tp_size=1, sp_size=2, sp_kind="all_to_all"),
    },
    4: {
        "dp2xtp2": lambda: HybridParallelPlugin(tp_size=2),
        "tp2xsp2": lambda: HybridParallelPlugin(tp_size=2, sp_size=2),
    },
}


SKIP = {
    # all-to-all attention is the same code for every family: run it on the two with masks that matter
    ("gpt2", "sp2-all_to_all"),
    ("vit", "sp2-all_to_all"),
}


def _cases(world: int) -> list[tuple[str, str]]:
    cases = [(f, name) for f in FAMILIES for name in PLUGINS[world] if (f, name) not in SKIP]
    # Mixtral: tp of the attention with replicated experts, and sp (the hybrid policy's two axes)
    return cases + ([("mixtral", "tp2"), ("mixtral", "sp2-ring")] if world == 2 else [])


def _all_cases(world: int) -> dict:
    out = {}
    for family, name in _cases(world):
        try:
            out[family, name] = boosted_losses(PLUGINS[world][name](), lambda f=family: build(f), batches(family), loss)
        except Exception as e:  # noqa: BLE001 (reported per case by the test)
            out[family, name] = f"{type(e).__name__}: {e}"
    return out, _gpt2_tp_state() if world == 2 else None


def _gpt2_tp_state() -> dict:
    """GPT-2 boosted with tp=2 (per-head ``c_attn``, transposed ``Conv1D`` weights), as a full state dict."""
    torch.manual_seed(0)
    plugin = HybridParallelPlugin(tp_size=2)
    model = build("gpt2")
    model, *_ = Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))
    return plugin.full_model_state_dict(model.module)


@pytest.mark.parametrize("world", [2, 4])
def test_hf_models_train_like_plain_pytorch_under_every_plugin(world):
    refs = {f: torch.tensor(dense_losses(lambda f=f: build(f), batches(f), loss)) for f, _ in _cases(world)}
    failures = []
    for rank, (got, state) in enumerate(run_distributed(_all_cases, world, world, timeout=300)):
        if state is not None:  # the Hugging Face names and dense shapes and values, untouched by tp
            torch.manual_seed(0)
            torch.testing.assert_close(state, dict(build("gpt2").state_dict()), rtol=0, atol=0)
        for (family, name), losses in got.items():
            if isinstance(losses, str):
                failures.append(f"rank {rank} {family} {name}: {losses}")
                continue
            try:
                torch.testing.assert_close(torch.tensor(losses), refs[family], rtol=1e-5, atol=0)
            except AssertionError as e:
                failures.append(f"rank {rank} {family} {name}: {losses} vs {refs[family].tolist()}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_hf_model_built_on_meta_gets_transformers_init(family):
    """A Hugging Face model built on the meta device and boosted (materialised with ``to_empty``)
    is initialised by the model's own ``_init_weights``: GPT-2's ``Conv1D`` and BERT's
    ``position_ids`` buffer have no ``reset_parameters`` and were left as uninitialised memory."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build(family)
    std = model.config.initializer_range
    boosted, *_ = Booster(plugin=TorchDDPPlugin()).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = boosted.unwrap()
    names = dict(model.named_parameters())
    name = "transformer.h.0.mlp.c_fc.weight" if family == "gpt2" else "bert.encoder.layer.0.output.dense.weight"
    weight = names[name]
    assert abs(weight.std().item() - std) < 0.2 * std and abs(weight.mean().item()) < 0.2 * std
    for name, p in names.items():
        if "LayerNorm.weight" in name or name.endswith(("ln_1.weight", "ln_f.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        if name.endswith(("c_fc.bias", "dense.bias")):
            assert torch.equal(p, torch.zeros_like(p)), name
    if family == "bert":
        ids = model.bert.embeddings.position_ids
        assert torch.equal(ids.flatten(), torch.arange(ids.numel())), ids
    assert torch.isfinite(loss(model, batches(family, 1)[0]))
