"""Every schedule on 2 and 4 ranks equals single-process training (loss on every rank and every
gradient, fp32, 1e-5 of the norm; see ``pp_testing.TOL``), with tied embeddings, activation
checkpointing and uneven stages; the executor's measured peak of held activations equals the
schedule's theory; each rank materialises only its own tensors."""

import pytest
import torch
from pp_testing import check_pipeline

from colossal.comm.testing import run_distributed
from colossal.pipeline import PipelineConfig
from colossal.pipeline.p2p import send_release_points, split_steps

# (schedule, v, m, tied, checkpointing, partition, sizes)
CASES = [
    ("gpipe", 1, 4, False, False, "uniform", None),
    ("1f1b", 1, 4, True, False, "uniform", None),
    ("1f1b", 1, 8, False, True, "params", None),
    ("interleaved", 2, 4, True, False, "uniform", None),
    ("zero_bubble", 1, 4, True, True, "uniform", None),
    ("zero_bubble", 1, 2, False, False, "uniform", None),
]
UNEVEN = {2: [5, 3], 4: [3, 1, 2, 2]}


def _theory(sched, p, m, v, r):
    if sched == "gpipe":
        return m
    if sched == "interleaved":
        return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
    return min(m, p - r)


def _held_sends(pipe) -> int:
    """Most sends the overlap mode holds at once when each is released where
    ``send_release_points`` says (every send of the rank when nothing is released before the end)."""
    plan, held, peak = send_release_points(pipe.schedule, pipe.rank), set(), 0
    for j, (_, _, sends) in enumerate(split_steps(pipe.schedule.actions(pipe.rank))):
        held = (held - set(plan[j])) | set(sends)
        peak = max(peak, len(held))
    return peak


def _rank(cases, p2p="auto"):
    p, r = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for sched, v, m, tied, ckpt, part, sizes in cases:
        cfg = PipelineConfig(
            num_microbatches=m, schedule=sched, virtual=v, activation_checkpointing=ckpt, partition=part, sizes=sizes,
            p2p=p2p,
        )  # fmt: skip
        pipe = check_pipeline(cfg, tied)
        assert pipe.stats.peak_inflight == _theory(sched, p, m, v, r), (cfg, pipe.stats)
        if pipe.p2p_mode == "overlap":  # sent tensors freed as soon as the peer is known to have them
            assert pipe.stats.peak_sends == _held_sends(pipe), (cfg, pipe.stats)
        real = {n for n, t in pipe.model.state_dict(keep_vars=True).items() if not t.is_meta}
        tie = {"wte.weight", "lm_head.weight"} if tied and real & {"wte.weight", "lm_head.weight"} else set()
        assert real == set(pipe.state_dict()) | tie, (cfg, real)  # nothing beyond this rank's chunks is real
        assert r == 0 or "wpe.weight" not in real
        assert r == p - 1 or "ln_f.weight" not in real


@pytest.mark.parametrize("world", [2, 4])
def test_schedules_match_single_process(world):
    cases = CASES + [("1f1b", 1, 4, True, False, "sizes", UNEVEN[world])]
    run_distributed(_rank, world, cases, timeout=240)


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_p2p_the_nccl_order_matches_too(world):
    """The grouped mode NCCL runs (one ordered batch per exchange point, ``[Note: p2p order on
    NCCL]``), forced on gloo: same results, for every schedule (interleaved on 2 ranks takes the
    paired blocks, on 4 the unpaired)."""
    cases = [c for c in CASES if c[4] is False][:4] + [("interleaved", 2, 8, False, False, "uniform", None)]
    run_distributed(_rank, world, cases, "grouped", timeout=240)


def test_built_eagerly_matches_too():
    run_distributed(_eager, 2, timeout=120)


def _eager():
    check_pipeline(PipelineConfig(num_microbatches=2, schedule="1f1b"), tied=True, meta=False)


def _accumulate():
    """Two steps without zeroing ``.grad`` accumulate like two ``loss.backward()`` calls (the tied
    embedding's two copies included)."""
    import copy

    from pp_testing import TOL, TinyGPT, batch, gpt_embed, gpt_head, lm_loss, reference, rel_err

    from colossal.pipeline import PipelineParallel

    torch.manual_seed(0)
    ref = TinyGPT(tied=True)
    sd = copy.deepcopy(ref.state_dict())
    (_, g1), (_, g2) = reference(ref, [1, 2])
    with torch.device("meta"):
        model = TinyGPT(tied=True)
    pipe = PipelineParallel(model, PipelineConfig(num_microbatches=2, schedule="zero_bubble"), embed=gpt_embed,
                            head=gpt_head)  # fmt: skip
    pipe.load_state_dict(sd)
    for s in (1, 2):
        pipe.step(*batch(s), lm_loss)
    for n, p in pipe.named_parameters():
        assert rel_err(p.grad, g1[n] + g2[n]) <= TOL, n


def test_gradients_accumulate_across_steps():
    run_distributed(_accumulate, 2, timeout=120)
