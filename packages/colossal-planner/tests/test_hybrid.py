"""Hybrid layouts (``colossal.planner.hybrid``): the rules on a traced GPT, and bad input.

The peaks against the real ``HybridParallelPlugin`` are the meta-package's
``test_colossalai_plan_hybrid.py``; here the rules' own invariants."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.planner import Layout, hardware_preset, plan, predict_memory, predict_step_time, trace_model
from colossal.planner.hybrid import in_flight, rank_step
from colossal.planner.speed import comm_bytes


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        y = self.ln(x)
        q, k, v = (f(y).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.o(a)
        return x + self.down(nn.functional.gelu(self.up(x)))


class LM(nn.Module):
    """A model this repository never saw: its own names, a tied head."""

    def __init__(self, layers: int = 4, h: int = 32, heads: int = 4, vocab: int = 96) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.n_head = heads

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.layers:
            x = blk(x)
        return self.head(self.norm(x))


def _trace(**kw):
    return trace_model(LM, batch=2, seq=24, vocab_size=96, **kw)


def test_tp_splits_the_inner_tensors_and_weights():
    t = _trace()
    assert t.hidden == 32 and t.heads == 4 and len(t.blocks) == 4
    assert 0 < max(t.live_split) < max(t.live_block) <= max(t.live)
    whole = predict_memory(t, Layout(engine="hybrid")).breakdown
    half = predict_memory(t, Layout(engine="hybrid", tp=2)).breakdown
    # 2-D block weights, column biases and the vocabulary-sized tied embedding are halved; norms
    # and row biases are not, so a rank holds a little more than half
    assert whole["rank_params"] / 2 < half["rank_params"] < 0.6 * whole["rank_params"]
    assert half["activations"] < whole["activations"]
    # 6 all-reduces per block per micro-batch (2 row matmuls forward; q, k, v and up input grads)
    # plus the vocabulary-parallel embedding's
    calls = comm_bytes(t, Layout(engine="hybrid", tp=2))
    act = 2 * 24 * 32 * 4
    assert calls["tp:all_reduce"] == (6 * 4 + 1) * act


def test_pipeline_stages_hold_their_blocks_and_the_schedule_sets_the_micro_batches_in_flight():
    t = _trace()
    lay = Layout(engine="hybrid", pp=2, microbatches=4)
    first, last = rank_step(t, lay, 0), rank_step(t, lay, 1)
    # the tied embedding lives on both ends
    assert first.trace.numel + last.trace.numel > t.numel
    assert in_flight(lay, 0) == (2, 1) and in_flight(lay, 1) == (1, 1)
    assert first.in_flight_bytes > 0 == last.in_flight_bytes
    gpipe = Layout(engine="hybrid", pp=2, microbatches=4, pp_schedule="gpipe")
    assert in_flight(gpipe, 1) == (4, 1)
    inter = Layout(engine="hybrid", pp=2, microbatches=4, pp_schedule="interleaved", pp_virtual=2)
    assert in_flight(inter, 0) == (5, 2)  # min(m v, 2 (p - r - 1) + (v - 1) p + 1)
    assert predict_memory(t, gpipe).tiers.device > predict_memory(t, lay).tiers.device


def test_the_bubble_and_tensor_parallel_compute():
    t = trace_model(LM, batch=1, seq=24, vocab_size=96)
    hw = hardware_preset("dgx-a100")
    times = {s: predict_step_time(t, Layout(engine="hybrid", pp=2, microbatches=4, pp_schedule=s), hw).compute
             for s in ("gpipe", "zero_bubble")}  # fmt: skip
    assert times["zero_bubble"] < times["gpipe"]


def test_layouts_that_cannot_divide_the_model_name_the_values():
    t = _trace()
    with pytest.raises(ValueError, match="4 attention heads are not divisible by tp grid side 8"):
        predict_memory(t, Layout(engine="hybrid", tp=8))
    with pytest.raises(ValueError, match="4 blocks cannot be cut into pp \\* pp_virtual = 3"):
        predict_memory(t, Layout(engine="hybrid", pp=3))
    with pytest.raises(ValueError, match="ep=2, but the model has no experts"):
        predict_memory(t, Layout(engine="hybrid", dp=2, ep=2))
    hw = hardware_preset("dgx-a100")
    with pytest.raises(ValueError, match="seq=25 is not divisible by the 2 sequence-parallel ranks"):
        plan(LM, batch=2, seq=25, hardware=hw, layouts=[Layout(engine="hybrid", sp=2)],
             trace_kwargs={"vocab_size": 96})  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"engine": "zero", "zero_stage": 1, "tp": 2}, "needs engine='hybrid'"),
        ({"engine": "hybrid", "tp": 3, "tp_mode": "2d"}, "must be a square"),
        ({"engine": "hybrid", "tp": 4, "tp_mode": "3d"}, "must be a cube"),
        ({"engine": "hybrid", "tp": 8, "tp_mode": "2.5d", "tp_depth": 3}, "q\\^2 x tp_depth"),
        ({"engine": "hybrid", "pp": 2, "pp_virtual": 2}, "needs pp_schedule='interleaved'"),
        ({"engine": "hybrid", "pp": 2, "microbatches": 3, "pp_schedule": "interleaved"}, "divisible by pp=2"),
        ({"engine": "hybrid", "zero_stage": 3}, "must be 0 \\(DDP\\), 1 or 2"),
        ({"engine": "hybrid", "ep": 2}, "must divide the dp x sp ranks \\(1 x 1\\)"),
        ({"engine": "hybrid", "microbatches": 4}, "need pp > 1"),
        ({"engine": "hybrid", "pp_schedule": "interleaved", "pp_virtual": 2}, "need pp > 1"),
        ({"engine": "hybrid", "dp": 2, "zero_stage": 1, "precision": "fp16"}, "does not run fp16"),
        ({"engine": "hybrid", "pp_schedule": "pipedream"}, "pp_schedule must be one of"),
        ({"engine": "hybrid", "tp": 0}, "tp must be a positive int, got 0"),
    ],
)
def test_bad_hybrid_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_world_and_label():
    lay = Layout(engine="hybrid", dp=2, tp=4, pp=2, microbatches=4, precision=torch.bfloat16)
    assert lay.world == 16
    assert lay.label == "hybrid dp2 tp4 pp2(1f1b m4) bf16"


def test_the_vocabulary_embedding_is_split_not_the_positions():
    # positions outnumber the vocabulary: the split must still follow the vocabulary
    class Pos(LM):
        def __init__(self):
            super().__init__(vocab=16)
            self.pos = nn.Parameter(torch.zeros(64, 32))

        def forward(self, idx):
            return super().forward(idx) + 0 * self.pos.sum()

    t = trace_model(Pos, batch=2, seq=24, vocab_size=16)
    assert t.vocab == 16
    st = rank_step(t, Layout(engine="hybrid", tp=2), 0)
    sizes = {p.name: p.numel for p in st.trace.params}
    assert sizes["emb.weight"] == 16 * 32 // 2 and sizes["pos"] == 64 * 32


def test_plan_lists_hybrid_layouts_only_for_models_of_blocks():
    hw = hardware_preset("dgx-a100")
    kw = {"inputs": lambda b, s: (torch.zeros(b, s, 10),), "loss": lambda out, x: out.sum()}
    mlp = plan(lambda: nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10)), batch=8, seq=16, hardware=hw,
               trace_kwargs=kw)  # fmt: skip
    assert mlp and not any(c.layout.engine == "hybrid" for c in mlp)
    lm = plan(LM, batch=8, seq=24, hardware=hw, trace_kwargs={"vocab_size": 96})
    hybrid = [c for c in lm if c.layout.engine == "hybrid"]
    assert hybrid and all(c.layout.tp in (1, 2, 4) for c in hybrid)  # 4 heads: tp 8 cannot divide them
    cmd = next(c for c in hybrid if c.layout.pp > 1 and not c.layout.zero_stage).command("--model x", 8, 24)
    assert "--pp-size" in cmd and f"--nproc {hw.world_size}" in cmd
