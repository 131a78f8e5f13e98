"""``HybridParallelPlugin(tp_size=1, ep_size=2)`` on 4 ranks (dp 4 = edp 2 x ep 2) trains a tiny
MoE GPT exactly like one process holding every expert, with the Booster adding the MoE auxiliary
losses; its checkpoint resumes at ep=1 and under the DDP plugin with the same next losses; bad
configurations raise on every rank before any collective.

The reference is one process holding all experts that runs each rank's batch in turn (capacity
and the load-balancing loss are per batch, so they must see the same batches) and steps AdamW on
the mean of the ranks' losses; fp32, 1e-5 relative (only the reduction order differs).
"""

import pytest
import torch
import torch.distributed as dist
from colossalai_harness import GLOBAL_BATCH, LR, SEQ, criterion, dataset, mean_over_dp

from colossal.comm.testing import run_distributed

KW = dict(num_experts=4, top_k=2, capacity_factor=1.0, block_size=SEQ)
STEPS, SAVE_AT, TOTAL = 3, 2, 4
CLIP = 0.5


def _model(**extra):
    from colossalai.models import build_moe_gpt

    torch.manual_seed(0)
    return build_moe_gpt("moe-tiny", seed=0, **KW, **extra)


def _setup(plugin, **booster_kw):
    from colossalai import Booster

    booster = Booster(plugin=plugin, **booster_kw)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
    model, optim, _, loader, _ = booster.boost(model, optim, criterion, loader)
    return booster, model, optim, loader


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-2)).item()


def _train(booster, model, optim, loader, steps, start=0, *, reference=False, save=None, model_kw=None):
    """Boosted losses (mean over dp) of steps ``start..steps-1``; with ``reference`` also a single
    process holding every expert (built with ``model_kw``) trains on the gathered rank batches,
    each cut into the pipeline's micro-batches (capacity and aux losses are per forward), and is
    compared each step."""
    from colossal.moe import moe_aux_loss
    from colossalai import RunState

    m = booster.plugin.num_microbatches if getattr(booster.plugin, "pp_size", 1) > 1 else 1
    full = _model(**(model_kw or {})) if reference else None
    ref_opt = torch.optim.AdamW(full.parameters(), lr=LR, weight_decay=0.1) if reference else None
    losses = []
    for step, (x, y) in enumerate(loader, start=start):
        if step == steps:
            break
        loss = booster.execute_pipeline((x, y), model, criterion, optim)
        norm = booster.clip_grad_norm(optim, CLIP)
        optim.step()
        optim.zero_grad()
        losses.append(mean_over_dp(loss, booster))
        if reference:
            group = booster.plugin.dp_group  # tp peers read the same batch
            batches = [None] * dist.get_world_size(group)
            dist.all_gather_object(batches, (x, y), group=group)
            chunks = [(cx, cy) for bx, by in batches for cx, cy in zip(bx.chunk(m), by.chunk(m), strict=True)]
            ref = sum(criterion(full(cx), cy) + moe_aux_loss(full) for cx, cy in chunks) / len(chunks)
            ref.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(full.parameters(), CLIP)
            ref_opt.step()
            ref_opt.zero_grad()
            assert abs(losses[-1] - ref.item()) <= 1e-5 * abs(ref.item()), (step, losses[-1], ref.item())
            assert abs(norm.item() - ref_norm.item()) <= 1e-5 * ref_norm.item(), (step, norm.item(), ref_norm.item())
        if save is not None and step + 1 == SAVE_AT:
            state = RunState(step=SAVE_AT, consumed_samples=SAVE_AT * GLOBAL_BATCH)
            booster.save_run(save, model, optim, state=state)
    if reference:
        state = booster.plugin.full_model_state_dict(model.module)
        assert sorted(state) == sorted(full.state_dict())  # pipeline: merged stage by stage
        # k_proj.bias: softmax ignores a bias shared by every key, so its exact gradient is 0 and
        # what it gets is rounding noise, which AdamW normalises into full-size steps
        bad = {n: _rel(state[n], t) for n, t in full.state_dict().items() if not n.endswith("k_proj.bias")}
        assert max(bad.values()) < 1e-5, {n: e for n, e in bad.items() if e >= 1e-5}
    return losses


def _ep_equals_dense(tp_size):
    from colossalai import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=tp_size, ep_size=2)
    booster, model, optim, loader = _setup(plugin)
    experts = model.unwrap().blocks[1].mlp.experts
    assert experts.w_in.shape[0] == 2, "each rank holds 2 of the 4 experts"
    edp = 2 if tp_size == 1 else 1
    assert dist.get_world_size(plugin._ep.groups.edp) == edp and dist.get_world_size(plugin._ep.groups.ep) == 2
    return _train(booster, model, optim, loader, STEPS, reference=True)


@pytest.mark.parametrize("tp_size", [1, 2], ids=["edp2-ep2", "ep2-tp2"])
def test_ep2_trains_like_one_process_with_every_expert(tp_size):
    """edp 2 x ep 2 with DDP; ep 2 x 1D tp 2 (dp 2 = ep 2), on 4 ranks."""
    losses = run_distributed(_ep_equals_dense, 4, tp_size, timeout=240)
    assert all(r == losses[0] for r in losses) and len(losses[0]) == STEPS


def _save(root):
    from colossalai import HybridParallelPlugin

    booster, model, optim, loader = _setup(HybridParallelPlugin(tp_size=1, ep_size=2))
    return _train(booster, model, optim, loader, TOTAL, save=root)


def _resume(kwargs, root):
    from colossalai import HybridParallelPlugin, TorchDDPPlugin

    plugin = HybridParallelPlugin(**kwargs) if kwargs else TorchDDPPlugin()
    booster, model, optim, loader = _setup(plugin)
    state = booster.load_run(root, model, optim, dataloader=loader)
    assert state.step == SAVE_AT
    return _train(booster, model, optim, loader, TOTAL, start=state.step)


@pytest.mark.parametrize("resume", [{"tp_size": 1, "ep_size": 1}, {}], ids=["hybrid-ep1", "ddp"])
def test_checkpoint_at_ep2_resumes_at_ep1_and_in_ddp(tmp_path, resume):
    before = run_distributed(_save, 4, str(tmp_path), timeout=240)[0]
    after = run_distributed(_resume, 4, resume, str(tmp_path), timeout=240)[0]
    assert len(after) == TOTAL - SAVE_AT
    for a, b in zip(after, before[SAVE_AT:]):
        assert abs(a - b) <= 1e-5 * abs(b), (after, before)


def _bad_configs():
    from colossalai import Booster, HybridParallelPlugin
    from colossalai.models import build_gpt, build_moe_gpt

    def boost(plugin, model):
        Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(ValueError, match="ep_size=3 must be a positive int dividing the data-parallel size 4"):
        boost(HybridParallelPlugin(tp_size=1, ep_size=3), build_moe_gpt("moe-tiny", seed=0))
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        boost(HybridParallelPlugin(tp_size=1, ep_size=4), build_moe_gpt("moe-tiny", num_experts=6, seed=0))
    with pytest.raises(ValueError, match="ep_size=2: the model has no colossal.moe.MoE layer"):
        boost(HybridParallelPlugin(tp_size=1, ep_size=2), build_gpt("tiny", seed=0))
    with pytest.raises(ValueError, match="ep_size must be a positive int, got 0"):
        HybridParallelPlugin(tp_size=1, ep_size=0)
    with pytest.raises(ValueError, match=r"ep_size=2 composes with dp .*\(unsupported combination\)"):
        HybridParallelPlugin(ep_size=2, tp_size=4, tp_mode="2d")
    with pytest.raises(ValueError, match=r"ep_size=2 with sp_size=2: \['blocks\.\d\.mlp'.* are colossal\.moe\.MoE"):
        boost(HybridParallelPlugin(tp_size=1, sp_size=2, ep_size=2), build_moe_gpt("moe-tiny", seed=0))
    dist.barrier()  # every rank got here: nothing above started a collective
    return True


def test_bad_configs_raise_on_every_rank_before_any_collective():
    assert run_distributed(_bad_configs, 4, timeout=120) == [True] * 4


def _aux_loss_switch():
    from colossalai import Booster, TorchDDPPlugin

    x = torch.randint(0, 256, (2, SEQ))
    out = {}
    for on in (True, False):
        booster = Booster(plugin=TorchDDPPlugin(), moe_aux_loss=on)
        model = _model()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optim, boosted_criterion, _, _ = booster.boost(model, optim, criterion)
        loss = booster.execute_pipeline((x, x), model, criterion, optim)
        plain = criterion(model(x), x).item()
        aux = model.unwrap().aux_loss().item()
        assert aux > 0
        assert boosted_criterion(model(x), x).item() == pytest.approx(plain + aux if on else plain, rel=1e-6)
        out[on] = (loss.item(), plain, aux)
    (on_loss, plain, aux), (off_loss, off_plain, _) = out[True], out[False]
    assert on_loss == pytest.approx(plain + aux, rel=1e-6) and off_loss == pytest.approx(off_plain, rel=1e-6)
    with pytest.raises(TypeError, match="moe_aux_loss must be a bool"):
        Booster(plugin=TorchDDPPlugin(), moe_aux_loss="yes")
    return True


def test_booster_adds_moe_aux_loss_switchably():
    assert run_distributed(_aux_loss_switch, 1, timeout=60) == [True]


def _save_then_train_on(root):
    from colossalai_harness import boosted_setup

    from colossalai import HybridParallelPlugin

    booster, model, optim, loader = boosted_setup(HybridParallelPlugin(tp_size=2))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        losses.append(mean_over_dp(booster.execute_pipeline((x, y), model, criterion, optim), booster))
        optim.step()
        optim.zero_grad()
        if step == 0:
            booster.save_optimizer(optim, root)  # used to leave DTensors in the live AdamW state
    return losses


def test_hybrid_trains_on_after_saving_the_optimizer(tmp_path):
    from colossalai_harness import reference_losses

    got = run_distributed(_save_then_train_on, 2, str(tmp_path), timeout=120)[0]
    want = reference_losses(3)
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want, strict=True)), (got, want)


def _ep_mixed(precision):
    from colossalai import HybridParallelPlugin

    out = {}
    for mode in ("fp32", precision):
        booster, model, optim, loader = _setup(HybridParallelPlugin(tp_size=1, ep_size=2), mixed_precision=mode)
        out[mode] = _train(booster, model, optim, loader, 2)
    return out


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ep2_mixed_precision_follows_fp32(precision):
    """fp16 (loss scaled, overflow agreed over every rank) and bf16 autocast: within 3e-2 of fp32."""
    out = run_distributed(_ep_mixed, 2, precision, timeout=180)[0]
    assert all(abs(a - b) <= 3e-2 * b for a, b in zip(out[precision], out["fp32"], strict=True)), out
