"""Per-micro-batch extras (``step(..., extras=)`` with ``block_call``): blocks that take a key-padding
mask besides the hidden state, on 2 ranks (1F1B with and without activation checkpointing, and
interleaved with two chunks per rank), equal single-process training of the same masked model
(loss and every gradient, fp32, 1e-5 of the norm, ``pp_testing.TOL``). A mask that matters:
padded rows differ from unpadded ones, so a pipeline that dropped or mixed up the micro-batches'
masks fails. Extras without the batch's rows raise on every rank before any transfer."""

import copy

import pytest
import torch
import torch.nn.functional as F
from pp_testing import BATCH, TOL, T, TinyGPT, batch, gpt_embed, gpt_head, lm_loss, rel_err

from colossal.comm.testing import run_distributed
from colossal.pipeline import PipelineConfig, PipelineParallel


def masked_block(block, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """``pp_testing.Block`` with causal attention restricted to the unpadded keys (``key_mask`` (b, T))."""
    b, t, c = x.shape
    q, k, v = block.qkv(block.ln_1(x)).split(c, dim=-1)
    q, k, v = (z.view(b, t, block.heads, c // block.heads).transpose(1, 2) for z in (q, k, v))  # (b, nh, T, hs)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    allowed = causal & key_mask[:, None, None, :].bool()  # (b, 1, T, T)
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)  # a fully padded row attends to itself
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(b, t, c)
    x = x + block.proj(y)
    return x + block.out(F.gelu(block.fc(block.ln_2(x))))


def _mask(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(T)[None, :] < torch.randint(1, T + 1, (BATCH, 1), generator=g)  # right padding per row
    return keep.long()


def _dense(model: TinyGPT, idx, mask) -> torch.Tensor:
    x = gpt_embed(model, idx)
    for blk in model.blocks:
        x = masked_block(blk, x, mask)
    return gpt_head(model, x)


def _rank(cases) -> None:
    for schedule, v, m, ckpt in cases:
        torch.manual_seed(0)
        ref = TinyGPT(tied=True)
        model = copy.deepcopy(ref)
        cfg = PipelineConfig(num_microbatches=m, schedule=schedule, virtual=v, activation_checkpointing=ckpt)
        pipe = PipelineParallel(
            model, cfg,
            embed=lambda mdl, idx, extras: gpt_embed(mdl, idx),
            head=lambda mdl, x, extras: gpt_head(mdl, x),
            block_call=lambda blk, x, extras: masked_block(blk, x, extras["key_mask"]),
        )  # fmt: skip
        for seed in (1, 2):
            idx, tgt = batch(seed)
            mask = _mask(seed)
            ref.zero_grad(set_to_none=True)
            want = lm_loss(_dense(ref, idx, mask), tgt)
            want.backward()
            grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
            for p in pipe.parameters():
                p.grad = None
            got = pipe.step(idx, tgt, lm_loss, extras={"key_mask": mask})
            assert abs(got.item() - want.item()) <= TOL * abs(want.item()), (schedule, got.item(), want.item())
            for n, p in pipe.named_parameters():
                err = rel_err(p.grad, grads[n])
                assert err <= TOL, f"{schedule} ckpt={ckpt}: gradient of {n} off by {err:.3g}"
        unmasked = lm_loss(gpt_head(ref, gpt_embed(ref, idx)), tgt)  # the mask changes the loss: it is used
        assert abs(unmasked.item() - want.item()) > 1e-3


def _bad_extras() -> str:
    torch.manual_seed(0)
    pipe = PipelineParallel(
        TinyGPT(), PipelineConfig(num_microbatches=2), embed=lambda m, i, e: gpt_embed(m, i),
        head=lambda m, x, e: gpt_head(m, x),
    )  # fmt: skip
    idx, tgt = batch(1)
    with pytest.raises(ValueError, match="extras must be tensors with the batch's 8 rows") as info:
        pipe.step(idx, tgt, lm_loss, extras={"key_mask": _mask(1)[:4]})
    return str(info.value)


def test_extras_reach_every_block_of_every_stage():
    cases = [("1f1b", 1, 4, False), ("1f1b", 1, 2, True), ("interleaved", 2, 2, False)]
    run_distributed(_rank, 2, cases, timeout=180)


def test_extras_without_the_batch_rows_raise_on_every_rank():
    messages = run_distributed(_bad_extras, 2, timeout=120)
    assert len(set(messages)) == 1 and "key_mask" in messages[0]
