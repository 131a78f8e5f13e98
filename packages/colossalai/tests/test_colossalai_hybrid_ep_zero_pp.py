"""Expert parallelism with ZeRO 1/2 and with pipeline parallelism in ``HybridParallelPlugin``.

- ep 2 x edp 2 x ZeRO-1/2 (dense states sharded over dp 4, expert states over edp 2) and
  ep 2 x 1D tp 2 x ZeRO-2 on 4 ranks train a tiny MoE GPT like one process holding every expert:
  losses, the clipped global norm and every final parameter, fp32, 1e-5 relative (only the
  reduction order differs).
- A checkpoint of ep 2 + ZeRO-2 resumes at ep 1 (hybrid, DDP-style) and in the DDP plugin with
  the same next losses, and a DDP checkpoint resumes under ep 2 + ZeRO-2.
- pp 2 x ep 2 on 4 ranks (MoE blocks on both stages, the aux losses added per stage) equals the
  reference, with DDP-style dp and with ZeRO-2.

The reference (``_train`` of ``test_colossalai_hybrid_ep_plugin``) runs each dp rank's batch in
turn through one process and steps AdamW on the mean of the ranks' losses plus aux losses.
"""

import pytest
import torch
from colossalai_harness import GLOBAL_BATCH, LR
from test_colossalai_hybrid_ep_plugin import KW, SAVE_AT, TOTAL, _train

from colossal.comm.testing import run_distributed

STEPS = 3


def _model(**extra):
    from colossalai.models import build_moe_gpt

    torch.manual_seed(0)
    return build_moe_gpt("moe-tiny", seed=0, **KW, **extra)


def _setup(plugin, **extra):
    from colossalai_harness import criterion, dataset

    from colossalai import Booster

    booster = Booster(plugin=plugin)
    model = _model(**extra)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
    model, optim, _, loader, _ = booster.boost(model, optim, criterion, loader)
    return booster, model, optim, loader


def _ep_zero_equals_dense(kwargs, extra):
    import torch.distributed as dist

    from colossalai import HybridParallelPlugin
    from colossalai.booster.hybrid.ep_zero import ExpertZeroOptimizer

    plugin = HybridParallelPlugin(**kwargs)
    booster, model, optim, loader = _setup(plugin, **extra)
    if kwargs.get("zero_stage"):
        zero = plugin._zero
        assert isinstance(zero, ExpertZeroOptimizer)
        edp = dist.get_world_size(plugin._ep.groups.edp)
        assert zero.expert.world == edp and zero.dense.world == plugin.dp_size()
        # the expert engine shards only experts, the dense one everything else
        held = {n for n, p in model.unwrap().named_parameters() if not p.is_meta}  # pp: this stage's
        assert set(zero.expert_names) == set(plugin._ep.dense_shapes) & held
        assert not set(zero.dense_names) & set(plugin._ep.dense_shapes)
    return _train(booster, model, optim, loader, STEPS, reference=True, model_kw=extra)


CASES = {
    "edp2-ep2-zero1": (dict(tp_size=1, ep_size=2, zero_stage=1), {}),
    "edp2-ep2-zero2": (dict(tp_size=1, ep_size=2, zero_stage=2), {}),
    "ep2-tp2-zero2": (dict(tp_size=2, ep_size=2, zero_stage=2), {}),
    "pp2-ep2": (dict(tp_size=1, ep_size=2, pp_size=2, num_microbatches=2), {"n_layer": 4}),
    "pp2-ep2-zero2": (dict(tp_size=1, ep_size=2, pp_size=2, num_microbatches=2, zero_stage=2), {"n_layer": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ep_with_zero_and_pp_trains_like_one_process_with_every_expert(case):
    kwargs, extra = CASES[case]
    losses = run_distributed(_ep_zero_equals_dense, 4, kwargs, extra, timeout=300)
    assert all(r == losses[0] for r in losses) and len(losses[0]) == STEPS


def _plugin(kwargs):
    from colossalai import HybridParallelPlugin, TorchDDPPlugin

    return HybridParallelPlugin(**kwargs) if kwargs else TorchDDPPlugin()


def _save(kwargs, root):
    booster, model, optim, loader = _setup(_plugin(kwargs))
    return _train(booster, model, optim, loader, TOTAL, save=root)


def _resume(kwargs, root):
    booster, model, optim, loader = _setup(_plugin(kwargs))
    state = booster.load_run(root, model, optim, dataloader=loader)
    assert state.step == SAVE_AT
    return _train(booster, model, optim, loader, TOTAL, start=state.step)


EP2_ZERO2 = dict(tp_size=1, ep_size=2, zero_stage=2)
RESUMES = {
    "ep2zero2-to-ep1": (EP2_ZERO2, dict(tp_size=1, ep_size=1)),
    "ep2zero2-to-ddp": (EP2_ZERO2, {}),
    "ddp-to-ep2zero2": ({}, EP2_ZERO2),
}


@pytest.mark.parametrize("pair", list(RESUMES))
def test_ep_zero_checkpoint_resumes_across_layouts(tmp_path, pair):
    save, resume = RESUMES[pair]
    before = run_distributed(_save, 4, save, str(tmp_path), timeout=240)[0]
    after = run_distributed(_resume, 4, resume, str(tmp_path), timeout=240)[0]
    assert len(after) == TOTAL - SAVE_AT
    for a, b in zip(after, before[SAVE_AT:]):
        assert abs(a - b) <= 1e-5 * abs(b), (after, before)


def _unsupported():
    import torch.distributed as dist

    from colossalai import Booster, HybridParallelPlugin
    from colossalai.models import build_moe_gpt

    with pytest.raises(ValueError, match="not with tp_mode='2d' \\(unsupported combination\\)"):
        HybridParallelPlugin(ep_size=2, tp_size=4, tp_mode="2d")
    model = build_moe_gpt("moe-tiny", seed=0)  # capacity and aux loss per rank: not per sequence chunk
    with pytest.raises(ValueError, match="with sp_size=2: .* are colossal.moe.MoE layers.*unsupported combination"):
        Booster(plugin=HybridParallelPlugin(tp_size=1, sp_size=2, ep_size=2)).boost(model)
    dist.barrier()  # nothing above started a collective
    return True


def test_ep_with_sp_or_2d_tp_raises_value_error_before_any_collective():
    assert run_distributed(_unsupported, 2, timeout=60) == [True] * 2


def _scheduler_reaches_both_engines():
    from colossalai_harness import criterion, dataset

    from colossalai import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=1, ep_size=2, zero_stage=2)
    booster = Booster(plugin=plugin)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 if step < 1 else 0.0)
    loader = booster.prepare_dataloader(dataset(), GLOBAL_BATCH // plugin.dp_size(), seed=0)
    model, optim, _, loader, sched = booster.boost(model, optim, criterion, loader, sched)
    params = lambda: [p.detach().clone() for p in model.unwrap().parameters()]  # noqa: E731
    moved = []
    for step, (x, y) in enumerate(loader):
        if step == 2:
            break
        before = params()
        booster.execute_pipeline((x, y), model, criterion, optim)
        optim.step()
        optim.zero_grad()
        sched.step()
        moved.append(sum(not torch.equal(a, b) for a, b in zip(before, params(), strict=True)))
    total = len(before)
    assert moved[0] == total, (moved, total)  # lr > 0: every parameter (dense and expert) moves
    assert moved[1] == 0, moved  # the scheduler set lr = 0 on the user's optimizer: nothing moves
    return moved


def test_lr_scheduler_on_the_users_optimizer_drives_both_zero_engines():
    run_distributed(_scheduler_reaches_both_engines, 2, timeout=120)
