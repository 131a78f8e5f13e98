"""LoRA under ``HybridParallelPlugin``: 1D tensor parallelism, sequence parallelism (ring and
all-to-all) and their compositions with dp / ZeRO, against plain single-process ``peft``.

A tiny GPT-2 (LoRA on ``c_attn``, the fused q/k/v whose tp layout is per head, ``c_fc``
column-parallel, both ``c_proj`` row-parallel), a tiny Llama (q/v/up column-, o/down
row-parallel) and the ``colossalai`` GPT (q/k/v column-parallel under a ``HEADS`` attention that
all-reduces their shared input gradient once, its vocabulary-parallel head) train 3 AdamW steps
(fp32). Each dp replica reads its share of the global batch
(tp and sp peers the same rows), so every layout computes the reference's loss. Losses match to
1e-5 relative; the frozen base weights are bitwise unchanged and never get a gradient. Adapter
folders go both ways with plain ``peft`` under tp2 (and ZeRO-3), a whole LoRA checkpoint from tp2
into ZeRO-3 and pp2; layouts and adapters that cannot be split are refused before any collective.

[Note: adapter weights and summation order]
Adam moves each element by ``lr * m / (sqrt(v) + eps)``, the gradient divided by its own size, so
an element whose gradient nearly cancels keeps few correct digits in fp32 whatever the layout
(``[Note: Adam and a near-cancelling gradient]`` in ``test_booster_lora.py``), and the weights
after it feed every later gradient. With LoRA on every linear layer there are many: one GPT-2
``c_fc.lora_A`` element has a step-1 gradient of 5.1e-6 where its tensor's largest is 6.1e-3;
plain peft in fp32 and in fp64 give it 5.09e-6 and 5.02e-6 and end 1.9e-5 apart, tp2 ends 2.8e-5
from the fp32 run, and a ``c_proj.lora_A`` element downstream of such updates 6e-6 (measured).
Adam's update is also blind to a gradient's scale. So the precision is carried by what sums many
elements: the per-step losses and the per-step dense gradient norm (every adapter gradient, each
element once over the tp group) to ``rtol=1e-5``, from the same fp32 computation in another order;
the weights get ``rtol=1e-5`` plus ``atol=1e-2 * lr`` (a wrong shard or a missing reduction moves
elements by about ``lr`` per step).
"""

import functools
import re

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import hf_models  # noqa: E402
from test_booster_lora import logits_of  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import Booster, HybridParallelPlugin, ZeroPlugin  # noqa: E402

STEPS, ROWS, T, V = 3, 4, 8, 64  # ROWS: the global batch
LR = 1e-2
WEIGHT_ATOL = 1e-2 * LR  # [Note: adapter weights and summation order]
TARGETS = {
    "gpt2": ["c_attn", "c_fc", "c_proj"],
    "llama": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    "gpt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"],  # the colossalai GPT
    "mixtral": ["q_proj", "v_proj", "o_proj"],  # the experts stay frozen (and split over ep)
    "palm": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_gate", "fc_in", "fc_out"],  # k/v: replicated
}
ADAPTED = {
    "gpt2": 4,
    "llama": 5,
    "gpt": 6,
    "mixtral": 3,
    "palm": 7,
}  # adapted modules per layer (GPT-2's c_proj: attn and mlp)
CASES = {  # name -> (family, world size, plugin arguments)
    "gpt2-tp2": ("gpt2", 2, {"tp_size": 2}),
    "gpt-tp2": ("gpt", 2, {"tp_size": 2}),
    "gpt-sp2-ring": ("gpt", 2, {"tp_size": 1, "sp_size": 2}),
    "palm-tp2": ("palm", 2, {"tp_size": 2}),
    "llama-tp2": ("llama", 2, {"tp_size": 2}),
    "llama-sp2-ring": ("llama", 2, {"tp_size": 1, "sp_size": 2}),
    "gpt2-sp2-all_to_all": ("gpt2", 2, {"tp_size": 1, "sp_size": 2, "sp_kind": "all_to_all"}),
    "gpt2-pp2": ("gpt2", 2, {"tp_size": 1, "pp_size": 2}),
    "llama-pp2-zero_bubble": ("llama", 2, {"tp_size": 1, "pp_size": 2, "pp_schedule": "zero_bubble"}),
    "gpt-pp2-interleaved": ("gpt", 2, {"tp_size": 1, "pp_size": 2, "pp_schedule": "interleaved", "pp_virtual": 1}),
    "mixtral-ep2": ("mixtral", 2, {"tp_size": 1, "ep_size": 2}),
    "llama-tp2-dp2-zero1": ("llama", 4, {"tp_size": 2, "zero_stage": 1}),
    "mixtral-tp2-ep2": ("mixtral", 4, {"tp_size": 2, "ep_size": 2}),
    "gpt2-pp2-tp2": ("gpt2", 4, {"tp_size": 2, "pp_size": 2}),
    "gpt-pp2-dp2-zero2": ("gpt", 4, {"tp_size": 1, "pp_size": 2, "zero_stage": 2}),
    "gpt2-tp2-sp2": ("gpt2", 4, {"tp_size": 2, "sp_size": 2}),
    "gpt-tp2-sp2": ("gpt", 4, {"tp_size": 2, "sp_size": 2}),
}


def base_model(family: str):
    """The seeded tiny model of ``family`` (no dropout): ``hf_models.build``, or the ``colossalai`` GPT."""
    torch.manual_seed(0)
    if family == "gpt":
        from colossalai.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=V, block_size=16, n_embd=32, n_layer=2, n_head=4))
    if family == "palm":  # multi-query attention: k_proj / v_proj stay replicated under tp
        from colossalai.models import PaLM, palm_config

        return PaLM(palm_config("palm-tiny", vocab_size=V, block_size=16))
    return hf_models.build(family)  # gpt2, llama, mixtral


def lora_config(family: str, **kw):
    fan = {"fan_in_fan_out": True} if family == "gpt2" else {}
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], **fan, **kw)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy, as the Hugging Face models compute it with ``labels=ids``."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def loss_of(family: str, model, ids: torch.Tensor) -> torch.Tensor:
    """The reference's loss: the model's own with ``labels`` (the colossalai GPT: logits only)."""
    if family not in ("gpt", "palm"):
        return model(input_ids=ids, labels=ids).loss
    return next_token_loss(model(ids), ids)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, V, (ROWS, T), generator=torch.Generator().manual_seed(100 + step))


@functools.cache
def reference(family: str):
    """Plain peft in one process: per-step losses and gradient norms, the state after 3 steps and before."""
    model = peft.get_peft_model(base_model(family), lora_config(family))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch(step)
        loss = loss_of(family, model, ids)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1e9).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict(), before


def _boost(family: str, plugin, model=None):
    booster = Booster(plugin=plugin)
    model = booster.enable_lora(model if model is not None else base_model(family), lora_config(family))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optim, *_ = booster.boost(model, optim)
    return booster, model, optim


def _train(family: str, kwargs: dict):
    booster, model, optim = _boost(family, HybridParallelPlugin(**kwargs))
    plugin = booster.plugin
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch(step).chunk(plugin.dp_size())[plugin.dp_rank()]
        x = ids if family in ("gpt", "palm") else {"input_ids": ids}
        loss = booster.execute_pipeline((x, ids), model, next_token_loss, optim)  # pp or not
        norms.append(optim.clip_grad_norm(1e9).item())  # the dense norm, each element once
        _check_only_the_adapter_trains(plugin.unwrap(model.module))
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    full = plugin.full_model_state_dict(model.module)
    return booster, model, (losses, norms, {k: v.detach().cpu().clone() for k, v in full.items()})


def _check_only_the_adapter_trains(model) -> None:
    """After boost the adapter alone requires grad (the axes' new layers must not unfreeze the
    base) and no frozen parameter got a gradient."""
    named = dict(model.named_parameters())
    trainable = sorted(n for n, p in named.items() if p.requires_grad and "lora_" not in n)
    assert not trainable, f"base parameters became trainable: {trainable[:4]}"
    grads = sorted(n for n, p in named.items() if p.grad is not None and not p.requires_grad)
    assert not grads, f"frozen parameters got a gradient: {grads[:4]}"


def _moe_gpt_run(kwargs: dict):
    """The colossalai MoE GPT (colossal.moe experts, per-rank capacity) with LoRA on its attention:
    per-step losses and dense gradient norms, each rank on its half of the batch."""
    from colossalai.models import build_moe_gpt

    booster = Booster(plugin=HybridParallelPlugin(**kwargs))
    model = build_moe_gpt("moe-tiny", seed=0, vocab_size=V, block_size=16)
    torch.manual_seed(0)  # the adapter's initialisation
    model = booster.enable_lora(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "out_proj"]))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optim, *_ = booster.boost(model, optim)
    out = []
    for step in range(STEPS):
        ids = batch(step).chunk(2)[dist.get_rank()]
        loss = booster.execute_pipeline((ids, ids), model, next_token_loss, optim)
        out.append(optim.clip_grad_norm(1e9).item())
        _check_only_the_adapter_trains(booster.plugin.unwrap(model.module))
        optim.step()
        optim.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        out.append(mean.item() / 2)
    return out


def _runs(names, root, plain):
    out = {name: _train(*CASES[name][::2])[2] for name in names}
    if dist.get_world_size() != 2:
        return out
    try:  # an adapter on a layer tp splits some other way (the vocabulary-parallel embedding): refused, named
        booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
        model = booster.enable_lora(base_model("gpt"), peft.LoraConfig(r=2, target_modules=["q_proj", "wte"]))
        booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    except NotImplementedError as e:
        out["vocab-embed"] = str(e)
    out["moe-dp2"], out["moe-ep2"] = (_moe_gpt_run({"tp_size": 1, "ep_size": ep}) for ep in (1, 2))
    x = batch(0)
    # Trained under tp2, saved as PEFT and merged: peft and transformers must read both.
    booster, model, _ = _train("gpt2", {"tp_size": 2})
    local = sum(p.numel() for p in booster.plugin.unwrap(model.module).parameters())
    out["index-maps"] = (booster.plugin._shards.nbytes, local)  # GPT-2's per-head layout keeps index maps
    booster.save_lora_as_pretrained(model, root / "tp2-adapter")
    booster.save_merged_as_pretrained(model, root / "tp2-merged")
    out["tp2-logits"] = logits_of(model, x)
    booster.save_model(model, root / "tp2-ckpt")  # the whole LoRA model: into ZeRO-3 and pp2
    trained = {k: v.clone() for k, v in booster.plugin.full_model_state_dict(model.module).items()}
    for name, plugin in (("zero3", ZeroPlugin(stage=3)), ("pp2", HybridParallelPlugin(tp_size=1, pp_size=2))):
        booster, model, _ = _boost("gpt2", plugin)
        out[f"ckpt-{name}-result"] = booster.load_model(model, root / "tp2-ckpt")
        full = booster.plugin.full_model_state_dict(model.module)
        out[f"ckpt-{name}-equal"] = sorted(k for k, v in trained.items() if not torch.equal(full[k], v))
    # A plain peft folder (LoRA on every linear layer) into models boosted under tp2 and ZeRO-3.
    for name, plugin in (("tp2", HybridParallelPlugin(tp_size=2)), ("zero3", ZeroPlugin(stage=3))):
        booster, model, _ = _boost("gpt2", plugin)
        out[f"{name}-missing"] = booster.load_lora(model, plain)
        out[f"{name}-plain"] = logits_of(model, x)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-hybrid")
    plain_model = peft.get_peft_model(base_model("gpt2"), lora_config("gpt2", init_lora_weights=False))
    plain_model.save_pretrained(root / "plain")
    out = {}
    for world in (2, 4):
        names = [n for n, (_, w, _) in CASES.items() if w == world]
        out.update(run_distributed(_runs, world, names, root, root / "plain", timeout=240)[0])
    return root, out, plain_model


@pytest.mark.parametrize("name", CASES)
def test_lora_under_the_hybrid_plugin_matches_plain_peft(results, name):
    family = CASES[name][0]
    losses, norms, state = results[1][name]
    ref_losses, ref_norms, ref_state, before = reference(family)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert set(state) == set(ref_state)
    adapters = [k for k in ref_state if "lora_" in k]
    assert len(adapters) == 2 * ADAPTED[family] * 2  # A and B of every adapted module of both layers
    for k in adapters:  # [Note: adapter weights and summation order]
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
    changed = [k for k in ref_state if "lora_" not in k and not torch.equal(state[k], before[k])]
    assert not changed, f"base weights changed: {changed}"


def test_moe_gpt_experts_stay_frozen_under_expert_parallelism(results):
    """ep2 trains what dp2 trains (the same per-rank capacity: equal per-step losses and norms)."""
    torch.testing.assert_close(
        torch.tensor(results[1]["moe-ep2"]), torch.tensor(results[1]["moe-dp2"]), rtol=1e-5, atol=0
    )


def test_the_index_maps_of_a_permuted_layout_stay_small(results):
    """[Note: compact index maps] in colossalai.booster.hybrid.shards: separable maps are two
    vectors, not one int per element (GPT-2 16 x 512 under tp2: 0.64 MiB instead of 100 MiB)."""
    nbytes, local = results[1]["index-maps"]
    assert nbytes < 0.25 * 4 * local, (nbytes, local)  # this tiny model's 1-D biases and norms are most of it


def test_adapter_trained_under_tp2_loads_in_plain_peft_and_merges(results):
    root, out, _ = results
    model = peft.PeftModel.from_pretrained(base_model("gpt2"), root / "tp2-adapter")
    torch.testing.assert_close(logits_of(model, batch(0)), out["tp2-logits"], rtol=1e-5, atol=1e-6)
    merged = transformers.GPT2LMHeadModel.from_pretrained(root / "tp2-merged")
    torch.testing.assert_close(logits_of(merged, batch(0)), out["tp2-logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["zero3", "pp2"])
def test_a_lora_checkpoint_saved_under_tp2_loads_under_zero3_and_pp2(results, name):
    _, out, _ = results
    result = out[f"ckpt-{name}-result"]
    assert not (result.missing or result.unexpected or result.mismatched)
    assert out[f"ckpt-{name}-equal"] == []  # every tensor, base and adapter, bitwise


@pytest.mark.parametrize("name", ["tp2", "zero3"])
def test_plain_peft_adapter_loads_under_tp2_and_zero3(results, name):
    _, out, plain_model = results
    assert not out[f"{name}-missing"]
    torch.testing.assert_close(out[f"{name}-plain"], logits_of(plain_model, batch(0)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 4, "tp_mode": "2d"}, r"needs tp_mode '1d' \(got '2d'\); LoRA composes with 1D tp, sp, pp, ep"),
        ({"tp_size": 8, "tp_mode": "3d"}, r"needs tp_mode '1d' \(got '3d'\)"),
    ],
)
def test_grid_tensor_parallel_modes_are_refused_before_boost(kwargs, message):
    with pytest.raises(NotImplementedError, match=message):
        Booster(plugin=HybridParallelPlugin(**kwargs)).enable_lora(base_model("gpt2"), lora_config("gpt2"))
    model = peft.get_peft_model(base_model("gpt2"), lora_config("gpt2"))  # wrapped by the user: refused at boost
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    with pytest.raises(NotImplementedError, match=re.escape("LoRA")):
        Booster(plugin=HybridParallelPlugin(**kwargs)).boost(model, optim)


def test_an_adapter_on_a_layer_split_otherwise_is_refused_naming_it(results):
    assert re.search(r"'wte' became VocabParallelEmbedding1D; adapters follow column- and row-parallel linear",
                     results[1]["vocab-embed"])  # fmt: skip


def test_an_adapter_inside_the_experts_is_refused_under_expert_parallelism():
    """The experts split over ep are frozen base weights; peft's ``target_parameters`` puts a LoRA
    layer around Mixtral's stacked experts: refused at boost, naming it, before any collective."""
    model = peft.get_peft_model(
        base_model("mixtral"),
        peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"]),
    )
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    with pytest.raises(NotImplementedError, match=r"inside expert layers split over ep: \['.*layers\.0\.mlp\."):
        Booster(plugin=HybridParallelPlugin(tp_size=1, ep_size=2)).boost(model, optim)


def test_dora_under_tp_and_a_meta_peft_model_are_refused_at_boost():
    dora = peft.get_peft_model(base_model("llama"), lora_config("llama", use_dora=True))
    optim = torch.optim.AdamW([p for p in dora.parameters() if p.requires_grad], lr=LR)
    with pytest.raises(NotImplementedError, match=r"'model\.layers\.0\.self_attn\.q_proj' uses a LoRA variant"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(dora, optim)
    with torch.device("meta"):
        meta = peft.get_peft_model(base_model("llama"), lora_config("llama"))
    optim = torch.optim.AdamW([p for p in meta.parameters() if p.requires_grad], lr=LR)
    with pytest.raises(NotImplementedError, match=r"meta tensors .* would re-initialise its adapter"):
        Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2)).boost(meta, optim)


def test_refusals_at_boost_leave_no_process_group_behind():
    """The checks above run before the plugin makes a world of one (later tests of this process
    expect none)."""
    assert not dist.is_initialized()
