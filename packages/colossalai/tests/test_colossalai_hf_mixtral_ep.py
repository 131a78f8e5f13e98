"""Hugging Face Mixtral with its experts split by ``HybridParallelPlugin(ep_size=2)``.

A tiny random ``MixtralForCausalLM`` (4 experts, top-2; built locally, never downloaded) trains 3
steps with AdamW under ep=2 on 2 ranks, ep2 x dp2 (DDP and ZeRO-2) and ep2 x tp2 on 4 ranks, with
and without the model's own router aux loss (``output_router_logits=True``), and ep2 x sp2 (ring
attention; the experts split over the sp ranks on 2 ranks, over dp x sp with DDP and ZeRO-2 on 4;
``[Note: expert x sequence parallelism]``; without the aux loss, refused under sp), against plain PyTorch
on the same unwrapped model: each step averages the losses of the dp ranks' rows of the global batch (the
aux loss is per forward, so the reference runs each rank's rows as its own forward, as DDP's
average of the ranks' losses does). fp32, rtol 1e-5: the same sums in another order (grouped
matmuls over expert-sorted rows instead of a loop over experts, gradient averages over ranks).

Checkpoints: a folder written by ``transformers``' own ``save_pretrained`` (per-expert layout)
loads into the ep=2 model with the folder's logits; after 3 steps ``Booster.save_pretrained``
writes a folder that ``MixtralForCausalLM.from_pretrained`` loads strictly with the trained
logits, each rank reading only its own experts. Bad sizes raise ``ValueError`` on every rank
before any collective.
"""

import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import batches, logits_of  # noqa: E402
from plan_harness import LR, boosted_losses, errors_on_every_rank  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import Booster, HybridParallelPlugin  # noqa: E402
from colossalai.checkpoint import hf as hf_io  # noqa: E402

V = 64
CASES = {  # name -> (world, plugin kwargs, router aux loss)
    "ep2": (2, dict(tp_size=1, ep_size=2), False),
    "ep2-aux": (2, dict(tp_size=1, ep_size=2), True),
    "ep2xdp2-aux": (4, dict(tp_size=1, ep_size=2), True),
    "ep2xtp2-aux": (4, dict(tp_size=2, ep_size=2), True),
    "ep2xdp2-zero2": (4, dict(tp_size=1, ep_size=2, zero_stage=2), False),
    "ep2xsp2": (2, dict(tp_size=1, ep_size=2, sp_size=2), False),  # the ep group is the sp group
    "ep2xsp2xdp2": (4, dict(tp_size=1, ep_size=2, sp_size=2), False),
    "ep2xsp2xdp2-zero2": (4, dict(tp_size=1, ep_size=2, sp_size=2, zero_stage=2), False),
}


def mixtral_config(aux: bool = False, experts: int = 4):
    return transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, max_position_embeddings=32, num_local_experts=experts, num_experts_per_tok=2,
        use_cache=False, output_router_logits=aux, router_aux_loss_coef=0.5,
    )  # fmt: skip


def build(aux: bool = False, experts: int = 4):
    return transformers.MixtralForCausalLM(mixtral_config(aux, experts))


def loss(model, batch: dict) -> torch.Tensor:
    return model(**batch).loss  # cross entropy, plus router_aux_loss_coef * aux loss when enabled


def reference_losses(aux: bool, dp: int) -> list[float]:
    """Plain PyTorch: each step the mean of the dp ranks' losses, each rank's rows one forward."""
    torch.manual_seed(0)
    model = build(aux)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for batch in batches("mixtral"):
        rows = batch["input_ids"].shape[0] // dp
        step = sum(loss(model, {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}) for r in range(dp)) / dp
        step.backward()
        optim.step()
        optim.zero_grad()
        out.append(step.item())
    return out


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed))


def _round_trip(src: str, out: str) -> dict:
    """ep=2: load the transformers folder into a fresh model, train 3 steps, export."""
    torch.manual_seed(123)  # weights that differ from the folder's
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, ep_size=2))
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optim, *_ = booster.boost(model, optim)
    readers, original = [], hf_io.SafetensorsReader

    def recording(*args, **kwargs):  # counts what this rank reads, in pieces smaller than an expert
        readers.append(original(*args, piece_numel=256, **kwargs))
        return readers[-1]

    hf_io.SafetensorsReader = recording
    try:
        skipped = booster.load_pretrained(model, src)
    finally:
        hf_io.SafetensorsReader = original
    result = {"skipped": skipped, "loaded": logits_of(model, tokens(0)), "read": readers[-1].read_numel}
    for step in range(3):
        booster.backward(loss(model, {"input_ids": tokens(10 + step), "labels": tokens(10 + step)}), optim)
        optim.step()
        optim.zero_grad()
    result["trained"] = logits_of(model, tokens(0))
    booster.save_pretrained(model, out)
    return result


def _errors() -> list[str]:
    boost = lambda plugin, model: Booster(plugin=plugin).boost(model)  # noqa: E731
    return [
        errors_on_every_rank(lambda: boost(HybridParallelPlugin(tp_size=1, ep_size=2), build(experts=3))),
        errors_on_every_rank(lambda: boost(HybridParallelPlugin(ep_size=2), build())),  # tp 2 leaves dp 1
    ]


def _run(world: int, src: str | None, out: str | None) -> dict:
    got = {}
    for name, (w, kw, aux) in CASES.items():
        if w == world:
            got[name] = boosted_losses(HybridParallelPlugin(**kw), lambda a=aux: build(a), batches("mixtral"), loss)
    if src is not None:
        got["round_trip"] = _round_trip(src, out)
        got["errors"] = _errors()
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_mixtral_expert_parallel_trains_like_plain_pytorch(tmp_path, world):
    src = out = None
    if world == 2:  # the checkpoint round trip rides along with the 2-rank spawn
        torch.manual_seed(0)
        build().save_pretrained(tmp_path / "src")
        src, out = str(tmp_path / "src"), str(tmp_path / "out")
    results = run_distributed(_run, world, world, src, out, timeout=240)
    for name, (w, kw, aux) in CASES.items():
        if w != world:
            continue
        want = torch.tensor(reference_losses(aux, world // (kw["tp_size"] * kw.get("sp_size", 1))))
        for rank, got in enumerate(results):
            torch.testing.assert_close(torch.tensor(got[name]), want, rtol=1e-5, atol=0, msg=f"{name} rank {rank}")
    if world == 4:
        return
    assert results[0]["ep2-aux"] != results[0]["ep2"]  # the aux loss was in the trained loss

    # transformers' own folder (per-expert layout) -> ep=2 -> 3 steps -> export -> from_pretrained
    assert any("block_sparse_moe.experts.3.w2" in k for k in _names(src))
    folder_model = transformers.MixtralForCausalLM.from_pretrained(src)
    total = sum(t.numel() for t in folder_model.state_dict().values())
    exported, info = transformers.MixtralForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    for r in results:
        rt = r["round_trip"]
        assert not any(rt["skipped"])
        assert rt["read"] < 0.7 * total, (rt["read"], total)  # half of the experts (80% of the model) each
        torch.testing.assert_close(rt["loaded"], logits_of(folder_model, tokens(0)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits_of(exported, tokens(0)), rt["trained"], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(rt["trained"], rt["loaded"])  # the 3 steps changed the model
        e1, e2 = r["errors"]
        assert "num_experts=4" not in e1 and "num_experts=3 is not divisible by ep_size=2" in e1, e1
        assert "ep_size=2 must be a positive int dividing the data-parallel size 1" in e2, e2


def _names(folder) -> list[str]:
    from safetensors import safe_open

    names = []
    for f in pathlib.Path(folder).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            names += list(h.keys())
    return names


def test_unstacked_experts_are_refused_by_name():
    """transformers 4.x kept Mixtral's experts in a ModuleList under ``block_sparse_moe``: expert
    parallelism refuses it (NotImplementedError naming the module), without any process group."""
    from torch import nn

    from colossalai.booster.hybrid.ep import check_ep

    model = build()
    old = nn.Module()
    old.gate, old.top_k = nn.Linear(32, 4, bias=False), 2
    old.experts = nn.ModuleList(nn.Linear(32, 64) for _ in range(4))
    model.model.layers[1].block_sparse_moe = old
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.block_sparse_moe \(Module\)"):
        check_ep(model, 2, 2)
    assert sorted(check_ep(build(), 2, 2)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
