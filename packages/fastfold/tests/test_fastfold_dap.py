"""Dynamic axial parallelism on 2 and 4 gloo ranks equals the single-rank model: forward outputs,
input gradients and (summed) parameter gradients, with residue and sequence counts that need
padding. float64, 1e-9: the ranks differ from the reference only by summation order."""

import pytest
import torch
from fastfold_testutils import rand, rand_mask, randomize_, tiny_evo, tiny_extra, tiny_template

from colossal.comm import CommCounter, register_observer
from colossal.comm.testing import run_distributed
from fastfold import Dap, EvoformerStack, ExtraMSAStack, TemplatePairStack, reduce_gradients

TOL = dict(rtol=1e-9, atol=1e-9)


def _loss(outs, seed=7):
    return sum((o * rand(*o.shape, seed=seed + i)).sum() for i, o in enumerate(outs))


def _run(model, args, kwargs, n_grad):
    model.zero_grad()
    args = [a.detach().requires_grad_(i < n_grad) for i, a in enumerate(args)]
    outs = model(*args, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    _loss(outs).backward()
    return outs, [a.grad for a in args[:n_grad]]


def _compare(model, args, checkpoint=False, n_grad=2):
    """Inputs ``args[:n_grad]`` get gradients (never the masks)."""
    ref_outs, ref_in_grads = _run(model, args, {}, n_grad)
    ref_p = {n: p.grad.clone() for n, p in model.named_parameters()}
    dap = Dap()
    outs, in_grads = _run(model, args, {"dap": dap, "checkpoint": checkpoint} if checkpoint else {"dap": dap}, n_grad)
    reduce_gradients(model, dap)
    for a, b in zip(outs + tuple(in_grads), ref_outs + tuple(ref_in_grads)):
        torch.testing.assert_close(a, b, **TOL)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_p[n], **TOL, msg=f"gradient of {n}")
    return len(outs)


def rank_evoformer(n_seq, n_res, checkpoint):
    model = randomize_(EvoformerStack(tiny_evo()).double()).eval()
    args = [rand(n_seq, n_res, 12, seed=1), rand(n_res, n_res, 8, seed=2)]
    args += [rand_mask(n_seq, n_res, seed=3), rand_mask(n_res, n_res, seed=4)]
    return _compare(model, args, checkpoint)


def rank_extra_and_template(n_res):
    extra = randomize_(ExtraMSAStack(tiny_extra()).double()).eval()
    args = [rand(3, n_res, 6, seed=1), rand(n_res, n_res, 8, seed=2), rand_mask(3, n_res, seed=3)]
    _compare(extra, args)
    template = randomize_(TemplatePairStack(tiny_template()).double()).eval()
    _compare(
        template,
        [rand(2, n_res, n_res, 8, seed=5), rand(2, n_res, n_res, 8, seed=6)[..., 0].gt(-0.7).double()],
        n_grad=1,
    )
    return True


def rank_dap_chunked_inplace(n_seq, n_res):
    model = randomize_(EvoformerStack(tiny_evo()).double()).eval()
    args = [rand(n_seq, n_res, 12, seed=1), rand(n_res, n_res, 8, seed=2)]
    args += [rand_mask(n_seq, n_res, seed=3), rand_mask(n_res, n_res, seed=4)]
    with torch.no_grad():
        ref = model(*args)
        out = model(*args, chunk_size=2, inplace=True, dap=Dap())
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **TOL)


def rank_two_ranks_all_stacks():
    rank_dap_chunked_inplace(3, 7)
    rank_dap_chunked_inplace(2, 7)  # 2 sequences < c_hidden_opm 3: outer product mean contracted b-first
    rank_evoformer(2, 5, checkpoint=False)
    rank_evoformer(3, 7, checkpoint=False)
    rank_evoformer(3, 7, checkpoint=True)  # recomputation re-issues the collectives in backward
    return rank_extra_and_template(7)


def test_dap_2_ranks_evoformer_checkpointed_extra_msa_template():
    """R=7, S=3: both padded to 8 and 4; chunked in-place inference, plain, activation-checkpointed,
    Extra-MSA and template."""
    assert run_distributed(rank_two_ranks_all_stacks, 2, timeout=180) == [True, True]


def test_dap_4_ranks_evoformer():
    """R=9, S=5: padded to 12 and 8 (one rank holds only padding sequences)."""
    assert run_distributed(rank_evoformer, 4, 5, 9, False, timeout=180) == [3] * 4


def rank_evoformer_opm_order(order):
    from fastfold.model import OuterProductMean

    OuterProductMean._order = lambda self, *shape: order  # this rank process only
    return rank_evoformer(3, 7, True)


@pytest.mark.parametrize("order", ["a", "b"])
def test_dap_outer_product_mean_orders(order):
    """[Note: outer product mean contraction order] under DAP (the default at these sizes is the
    outer product first): W contracted into the local rows' a (what DAP picks at model sizes) or
    into the gathered b, checkpointed training, equal to the single-rank run."""
    assert run_distributed(rank_evoformer_opm_order, 2, order, timeout=180) == [3, 3]


def rank_comm_pattern():
    model = EvoformerStack(tiny_evo(no_blocks=2)).double().eval()
    events = []
    handle = register_observer(events.append)
    try:
        with torch.no_grad(), CommCounter() as counter:
            model(rand(4, 6, 12), rand(6, 6, 8), dap=Dap())
    finally:
        handle.remove()
    overlapped = sorted({e.tag for e in events if e.async_op})
    synchronous = sorted({e.tag for e in events if not e.async_op})
    return dict(counter.calls), overlapped, synchronous


def test_dap_comm_pattern_per_block():
    """Per block: 2 MSA all-to-alls (seq<->res), 4 pair switches (row<->col twice) of which the
    three inside the pair stack are pipelined in 2 pieces (7 calls), 6 all-gathers (row-attention
    bias, OPM right projection, the two triangle-update operands, the two triangle-attention
    biases; the OPM's mask comes whole from the block); the trunk adds 3 output gathers (m, z, s)."""
    calls, overlapped, synchronous = run_distributed(rank_comm_pattern, 2, timeout=60)[0]
    assert calls["all_to_all"] == 2 * (2 + 1 + 3 * 2)
    assert calls["all_gather"] == 2 * 6 + 3
    # the row-attention bias gather, the MSA all-to-all back to the sequence split and every pair
    # all-to-all run async (see test_fastfold_dap_overlap.py for the overlap itself)
    assert overlapped == ["fastfold.dap.all_to_all", "fastfold.dap.gather", "fastfold.dap.pair_all_to_all"]
    # still synchronous: the MSA switch after row attention, the output gathers
    assert synchronous == ["functional.all_to_all", "functional.gather"]


def rank_too_many_ranks():
    model = EvoformerStack(tiny_evo(no_blocks=1)).double()
    model(rand(2, 3, 12), rand(3, 3, 8), dap=Dap())


def test_dap_larger_than_residues_is_a_clear_error():
    with pytest.raises(ValueError, match="DAP size 4 is larger than the number of residues 3"):
        run_distributed(rank_too_many_ranks, 4, timeout=60)


def _seeded_run(seed, *args):
    torch.manual_seed(seed)
    return _run(*args)


def rank_dropout_matches_single_rank(n_seq, n_res):
    """Training mode with AlphaFold's dropout rates: the DAP run (other ranks seeded differently:
    the masks come from rank 0's seed) equals the single-rank run seeded like rank 0, with and
    without checkpointing; the masks do act (the eval-mode output differs)."""
    model = randomize_(EvoformerStack(tiny_evo(msa_dropout=0.15, pair_dropout=0.25)).double())
    args = [rand(n_seq, n_res, 12, seed=1), rand(n_res, n_res, 8, seed=2)]
    args += [rand_mask(n_seq, n_res, seed=3), rand_mask(n_res, n_res, seed=4)]
    rank = torch.distributed.get_rank()
    for checkpoint in (False, True):
        ref_outs, ref_grads = _seeded_run(11, model.train(), args, {"checkpoint": checkpoint}, 2)
        ref_p = {n: p.grad.clone() for n, p in model.named_parameters()}
        dap = Dap()
        kw = {"dap": dap, "checkpoint": checkpoint}
        outs, grads = _seeded_run(11 + 1000 * rank, model, args, kw, 2)
        reduce_gradients(model, dap)
        for a, b in zip(outs + tuple(grads), ref_outs + tuple(ref_grads)):
            torch.testing.assert_close(a, b, **TOL)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_p[n], **TOL, msg=f"gradient of {n}")
    with torch.no_grad():
        assert not torch.allclose(model.eval()(*args)[1], ref_outs[1])
    return True


def test_dap_dropout_equals_single_rank():
    """R=7, S=3 on 2 ranks (padded): the shared row/column masks are drawn over the unpadded
    residues from one broadcast seed (see [Note: dropout under DAP])."""
    assert run_distributed(rank_dropout_matches_single_rank, 2, 3, 7, timeout=180) == [True, True]
