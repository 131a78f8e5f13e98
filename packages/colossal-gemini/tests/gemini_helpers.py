"""Gemini pieces of the tests: the single-process reference on the testkit GPT and the same
training through ``GeminiDDP`` / ``GeminiOptimizer`` (the GPT and the parity checks themselves are
``colossal.testkit``'s, shared with the other suites).

The suite builds ``GPTConfig(init="torch")``: PyTorch's default initialisation, whose larger
weights keep Adam's magnified summation noise below the 1e-5 per-tensor tolerance (see the
``init`` field)."""

from __future__ import annotations

import copy

import torch

from colossal.testkit import GPT, GPTConfig, lm_loss, train_reference

__all__ = ["reference_gpt_run", "train_gemini"]


def reference_gpt_run(batches, lr=1e-2, dtype=torch.float32, seed=0):
    """Plain PyTorch AdamW training of ``GPT(GPTConfig(init="torch"))`` seeded with ``seed``; returns
    (initial state, final state, losses). ``dtype`` other than fp32 runs the forward under autocast."""
    torch.manual_seed(seed)
    ref = GPT(GPTConfig(init="torch"))
    init = copy.deepcopy(ref.state_dict())
    autocast = None if dtype == torch.float32 else dtype
    final, losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=lr), batches, autocast_dtype=autocast)
    return init, final, losses


def train_gemini(batches, init, lr=1e-2, **kwargs):
    """The same training through GeminiDDP/GeminiOptimizer; returns (model, losses)."""
    from colossal.gemini import GeminiDDP, GeminiOptimizer

    model = GPT(GPTConfig(init="torch"))
    model.load_state_dict(init)
    kwargs.setdefault("chunk_size", 8192)
    gem = GeminiDDP(model, **kwargs)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=lr), gem)
    losses = []
    for x, y in batches:
        loss = lm_loss(gem(x), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return gem, losses
