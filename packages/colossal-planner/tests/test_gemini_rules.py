"""Gemini's accounting rules as the planner restates them, on hand-computed cases (no colossal.gemini here:
``bench/validate_gemini.py`` holds the comparison with the real engine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colossal.planner.gemini import (
    gemini_memory,
    gemini_min_device_bytes,
    gemini_operator_needs,
    pack,
    plan_chunks,
    search_chunk_size,
)
from colossal.planner.layout import Layout
from colossal.planner.trace import trace_model

V, T, C = 64, 16, 16  # vocab, block size, width


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(C)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(C, C) for _ in range(4))
        self.ln_2 = nn.LayerNorm(C)
        self.fc_in, self.fc_out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(b, t, 2, C // 2).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, C)
        x = x + self.out_proj(y)
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class TinyGPT(nn.Module):
    """One block, tied output head: parameters 1024, 256, 16, 16, (256, 16) x 4, 16, 16, 1024, 64, 1024, 16,
    16, 16 in registration order (4592 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList([_Block()])
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.fixture(scope="module")
def traces():
    return {dt: trace_model(TinyGPT, batch=2, seq=T, dtype=dt, vocab_size=V) for dt in (torch.float32, torch.bfloat16)}


def _layout(**kw) -> Layout:
    return Layout(engine="gemini", **kw)


def test_packing_and_the_chunk_size_search_follow_the_engine():
    assert pack([3, 3, 2], 5) == [[0], [1, 2]]  # a tensor that does not fit opens a new chunk
    with pytest.raises(ValueError, match="smaller than a parameter"):
        pack([3, 7], 5)
    # candidates 3..6: padding 1, 4, 2, 4 -> 3; with align 2: 4, 6, 8 -> 8 packs [3, 3, 2] without padding
    assert search_chunk_size([3, 3, 2]) == 3
    assert search_chunk_size([3, 3, 2], align=2) == 8


def test_chunk_padding_and_sharding_totals(traces):
    trace = traces[torch.float32]
    assert trace.numel == 4592
    # 2048 elements: [wte, wpe, ln_1, q, k] = 1856 | [v, out, ln_2, fc_in] = 1664 | [fc_out, ln_f] = 1072
    plan = plan_chunks(trace, _layout(chunk_size=2048))
    assert [plan.used(c) for c in range(len(plan.chunks))] == [1856, 1664, 1072]
    assert 3 * plan.size - trace.numel == 1552  # padding
    two = plan_chunks(trace, _layout(chunk_size=2048, dp=2))
    assert (two.size, two.shard, two.shard_bytes) == (2048, 1024, 4096)
    # rank 0 holds the first 1024 elements of each chunk, rank 1 the rest (1856-1024, 1664-1024, 1072-1024)
    assert [two.slice_elems(c, 0) for c in range(3)] == [1024, 1024, 1024]
    assert [two.slice_elems(c, 1) for c in range(3)] == [832, 640, 48]
    # block = fp32 master + fp32 gradient over the whole shard (padding too) + 2 AdamW states over parameters
    assert sum(two.block_bytes(c, 0, 2) for c in range(3)) == 3 * 8 * 1024 + 8 * 3072
    assert sum(two.block_bytes(c, 1, 2) for c in range(3)) == 3 * 8 * 1024 + 8 * 1520
    assert plan_chunks(trace, _layout(chunk_size=2048, dp=3)).size == 2049  # rounded up to the ranks
    assert plan_chunks(trace, _layout(chunk_size=2048, dp=2, keep_gathered=True)).shard == 2048
    _, parts = gemini_memory(trace, _layout(chunk_size=2048, dp=2), device_memory=1 << 30)
    assert (parts["n_chunks"], parts["chunks"], parts["optimizer_blocks"]) == (3, 3 * 4096, 3 * 8192 + 8 * 3072)


def test_bf16_halves_the_chunks_but_not_the_fp32_optimizer_blocks(traces):
    got = {
        dt: gemini_memory(traces[dt], _layout(chunk_size=2048, precision=dt), device_memory=1 << 30)[1]
        for dt in (torch.float32, torch.bfloat16)
    }
    fp32, bf16 = got[torch.float32], got[torch.bfloat16]
    assert bf16["chunk_bytes"] * 2 == fp32["chunk_bytes"] == 2048 * 4
    assert bf16["chunks"] * 2 == fp32["chunks"]
    assert bf16["optimizer_blocks"] == fp32["optimizer_blocks"] == 3 * 8 * 2048 + 8 * 4592


def test_resident_fp32_step_counts_chunks_blocks_and_the_non_model_peak(traces):
    """Static, every block on the device, one rank, fp32: the resident fast path with the masters aliased
    to the chunks, whose freed fp32 buffers stay accounted ([Note: aliased masters])."""
    tiers, parts = gemini_memory(
        traces[torch.float32],
        _layout(placement="static", offload_optim_frac=0.0, chunk_size=2048),
        device_memory=1 << 30,
    )
    assert parts["optimizer_blocks_device"] == parts["optimizer_blocks"]
    assert parts["fast_path"] == 1
    assert tiers.device == parts["chunks"] + parts["optimizer_blocks"] + parts["non_model_peak"]
    # host: working shards, masters and gradients from construction, then the first block's states as it moves
    assert tiers.host == parts["chunks"] + 3 * 8 * 2048 + 8 * 1856 and tiers.pinned_host == 0
    assert gemini_memory(traces[torch.float32], _layout(), device_memory=1 << 30, device_type="cuda")[0].host == 0


def test_a_tiny_budget_reports_the_need(traces):
    trace = traces[torch.float32]
    layout = _layout(placement="auto", chunk_size=2048, device_budget=4096)
    tiers, parts = gemini_memory(trace, layout, device_memory=1 << 30)
    need = gemini_min_device_bytes(trace, layout)
    assert parts["fits"] == 0 and tiers.device >= need > 4096
    # the need of the operator that asks most: its chunk (8 KiB) next to the largest non-model bytes
    assert need == max(n for _, n in gemini_operator_needs(trace, layout)) >= 2048 * 4 + parts["non_model_peak"]
    roomy = gemini_memory(trace, _layout(placement="auto", chunk_size=2048, device_budget=need), device_memory=0)
    assert roomy[1]["fits"] == 1 and roomy[0].device <= need


def test_operators_are_the_modules_forward_and_backward(traces):
    labels = [label for label, _ in gemini_operator_needs(traces[torch.float32], _layout(chunk_size=2048))]
    fwd = [lab for lab in labels if lab.startswith("fwd:")]
    assert fwd[:3] == ["fwd:wte", "fwd:wpe", "fwd:blocks.0.ln_1"]
    assert fwd[-2:] == ["fwd:ln_f", "fwd:wte(tied head)"]  # the tied lm_head: found by its matmul
    assert labels[len(fwd)] == "bwd:wte(tied head)" and labels[-1] == "bwd:wte"
    assert len(labels) == 2 * 12


def test_disk_file_is_the_plan(traces):
    """Static disk plan over 3 chunks of 2048: the last chunk's shard + master (one region in fp32, two in
    bf16) and gradient, the last two chunks' two AdamW states; 4 KiB aligned regions."""
    kw = dict(placement="static", chunk_size=2048, disk=True, offload_param_frac=1.0, disk_param_frac=1 / 3)
    kw.update(disk_grad_frac=1 / 3, disk_optim_frac=2 / 3)
    fp32 = gemini_memory(traces[torch.float32], _layout(**kw), device_memory=1 << 30)[0]
    bf16 = gemini_memory(traces[torch.bfloat16], _layout(precision="bf16", **kw), device_memory=1 << 30)[0]
    assert fp32.disk == 8192 + 8192 + 2 * 2 * 8192
    assert bf16.disk == 4096 + fp32.disk
