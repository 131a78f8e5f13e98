"""Input validation and the block loop shared by the Evoformer and Extra-MSA stacks: default
masks, DAP padding and scatter/gather, activation checkpointing per block."""

from __future__ import annotations

import torch

from fastfold.chunk import check_chunk_size
from fastfold.model.dropout import draw_dropout_seed
from fastfold.ops import training_kernels
from fastfold.parallel.dap import pad_axis

__all__ = ["check_trunk_inputs", "run_trunk", "checkpoint_block"]

# [Note: checkpointing with the inference forward]
# A checkpointed block keeps nothing of its forward, so that forward has no use for autograd: it
# runs under ``torch.no_grad()`` and takes the inference fast paths (fused attention, the lean
# triangle update, in-place gates; OpenFold's reentrant checkpoint also runs it without autograd,
# but through its training code). Backward recomputes the block with autograd (the training
# paths) from the saved inputs and differentiates that. The two forwards run the same kernels on
# tensors of the same layouts (the fused attention has an autograd form, the lean triangle update
# runs under autograd, see [Note: fused attention in inference] and [Note: triangle update in
# inference]; both forwards run inside ``training_kernels()``, so small attentions take the eager
# path in both, see [Note: eager attention in training]), so they agree bit for bit and the
# gradients equal those of a plain autograd run
# (float32, tested). Were the kernels different, the next block would be differentiated at inputs
# a rounding away, which near a ReLU kink moved a weight gradient by 6.5e-5 of the largest. The block's
# parameters are inputs of the autograd node, so their gradients flow even when ``m`` and ``z``
# need none, and ``torch.autograd.grad`` works through it (not double backward). Dropout masks
# come from the block's own seeded generator (``SharedDropout``), so the recompute draws the same.


def _shape(t) -> tuple:
    return tuple(getattr(t, "shape", ()))


def check_trunk_inputs(m, z, msa_mask, pair_mask, c_m: int, c_z: int):
    """Validate ``m`` [*, S, R, c_m] and ``z`` [*, R, R, c_z]; return the masks (ones by default)."""
    for name, t in (("m", m), ("z", z)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            raise TypeError(f"{name} must be a tensor with at least 3 dims, got {type(t).__name__} {_shape(t)}")
    if m.shape[-1] != c_m:
        raise ValueError(f"m: expected [*, S, R, c_m={c_m}], got {_shape(m)}")
    n_seq, n_res = m.shape[-3], m.shape[-2]
    want_z = (*m.shape[:-3], n_res, n_res, c_z)
    if _shape(z) != want_z:
        raise ValueError(f"z: expected {want_z} (batch dims of m, R={n_res}, c_z={c_z}), got {_shape(z)}")
    msa_mask = m.new_ones(m.shape[:-1]) if msa_mask is None else msa_mask.to(m.dtype)
    pair_mask = z.new_ones(z.shape[:-1]) if pair_mask is None else pair_mask.to(z.dtype)
    if _shape(msa_mask) != _shape(m)[:-1]:
        raise ValueError(
            f"msa_mask: expected shape {_shape(m)[:-1]} ([*, S={n_seq}, R={n_res}]), got {_shape(msa_mask)}"
        )
    if _shape(pair_mask) != _shape(z)[:-1]:
        raise ValueError(f"pair_mask: expected shape {_shape(z)[:-1]} ([*, R, R]), got {_shape(pair_mask)}")
    return msa_mask, pair_mask


def _check_modes(chunk_size, inplace, checkpoint, dap, n_res):
    check_chunk_size(chunk_size)
    if inplace and torch.is_grad_enabled():
        raise ValueError("inplace=True is an inference mode: run it under torch.no_grad()/inference_mode()")
    if inplace and checkpoint:
        raise ValueError("inplace=True and checkpoint=True cannot be combined (checkpointing is for training)")
    if dap is not None and dap.size > n_res:
        raise ValueError(f"DAP size {dap.size} is larger than the number of residues {n_res}")


def _enter_dap(dap, m, z, msa_mask, pair_mask):
    s_pad, r_pad = dap.padded(m.shape[-3]), dap.padded(m.shape[-2])
    m = pad_axis(pad_axis(m, -3, s_pad), -2, r_pad)
    z = pad_axis(pad_axis(z, -3, r_pad), -2, r_pad)
    msa_mask = pad_axis(pad_axis(msa_mask, -2, s_pad), -1, r_pad)  # padding is masked out
    pair_mask = pad_axis(pad_axis(pair_mask, -2, r_pad), -1, r_pad)
    return dap.scatter(m, -3), dap.scatter(z, -2), msa_mask, pair_mask  # z: columns local between blocks


def run_trunk(blocks, m, z, msa_mask, pair_mask, cfg, chunk_size, inplace, dap, checkpoint):
    """Run ``blocks`` on whole inputs; returns whole ``(m, z, (msa_mask, pair_mask))``."""
    msa_mask, pair_mask = check_trunk_inputs(m, z, msa_mask, pair_mask, cfg.c_m, cfg.c_z)
    n_seq, n_res = m.shape[-3], m.shape[-2]
    _check_modes(chunk_size, inplace, checkpoint, dap, n_res)
    if inplace:
        m, z = m.clone(), z.clone()  # never mutate the caller's tensors
    if dap is not None:
        with torch.profiler.record_function("fastfold.dap::scatter"):
            m, z, msa_mask, pair_mask = _enter_dap(dap, m, z, msa_mask, pair_mask)
    drop = [None] * len(blocks)
    if any(b.training and (cfg.msa_dropout > 0 or cfg.pair_dropout > 0) for b in blocks):
        drop = draw_dropout_seed(len(blocks), n_res, m.device, dap)  # [Note: dropout under DAP]
    for block, d in zip(blocks, drop):
        if checkpoint and torch.is_grad_enabled():
            m, z = checkpoint_block(block, m, z, msa_mask, pair_mask, chunk_size, dap, d)
        else:
            m, z = block(m, z, msa_mask, pair_mask, chunk_size, inplace, dap, d)
    if dap is not None:
        with torch.profiler.record_function("fastfold.dap::gather"):
            m = dap.gather_output(m, -3)[..., :n_seq, :n_res, :]
            z = dap.gather_output(z, -2)[..., :n_res, :n_res, :]
            msa_mask, pair_mask = msa_mask[..., :n_seq, :n_res], pair_mask[..., :n_res, :n_res]
    return m, z, (msa_mask, pair_mask)


class _InferenceForwardCheckpoint(torch.autograd.Function):
    """See [Note: checkpointing with the inference forward]."""

    @staticmethod
    def forward(ctx, run, m, z, msa_mask, pair_mask, *params):
        ctx.run = run
        ctx.set_materialize_grads(False)  # an output the loss does not use stays None (see backward)
        ctx.save_for_backward(m, z, msa_mask, pair_mask)
        with torch.no_grad(), training_kernels():
            return run(m, z, msa_mask, pair_mask)

    @staticmethod
    def backward(ctx, grad_m, grad_z):
        if grad_m is None and grad_z is None:  # neither output reaches the loss (same on every DAP rank)
            return (None,) * (5 + len(ctx.run.params))
        m, z, msa_mask, pair_mask = ctx.saved_tensors
        m_in, z_in = (t.detach().requires_grad_(t.requires_grad) for t in (m, z))
        with torch.enable_grad(), training_kernels():
            out = ctx.run(m_in, z_in, msa_mask, pair_mask)
        params = [p for p in ctx.run.params if p.requires_grad]
        wrt = [t for t in (m_in, z_in) if t.requires_grad] + params
        # only the outputs that received a gradient: a parameter that reaches the loss through
        # neither keeps ``grad is None``, as in a plain run (not a zero gradient)
        outs, grad_outs = zip(*[(o, g) for o, g in zip(out, (grad_m, grad_z)) if g is not None])
        grads = iter(torch.autograd.grad(outs, wrt, grad_outs, allow_unused=True))
        g_m = next(grads) if m_in.requires_grad else None
        g_z = next(grads) if z_in.requires_grad else None
        by_param = {id(p): g for p, g in zip(params, grads)}
        return (None, g_m, g_z, None, None, *(by_param.get(id(p)) for p in ctx.run.params))


class _BlockRun:
    def __init__(self, block, chunk_size, dap, dropout):
        self.block, self.chunk_size, self.dap, self.dropout = block, chunk_size, dap, dropout
        self.params = list(block.parameters())

    def __call__(self, m, z, msa_mask, pair_mask):
        return self.block(m, z, msa_mask, pair_mask, self.chunk_size, False, self.dap, self.dropout)


def checkpoint_block(block, m, z, msa_mask, pair_mask, chunk_size=None, dap=None, dropout=None):
    """``block(m, z, ...)`` keeping only its inputs for backward: the forward runs without autograd
    (the inference paths), backward recomputes it with autograd (see [Note: checkpointing with the
    inference forward]). Returns the block's ``(m, z)``."""
    run = _BlockRun(block, chunk_size, dap, dropout)
    return _InferenceForwardCheckpoint.apply(run, m, z, msa_mask, pair_mask, *run.params)
