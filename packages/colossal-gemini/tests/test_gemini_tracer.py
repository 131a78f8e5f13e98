"""Tracing: live non-model storages are counted (views once, model storages never), per traced operator."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemini_helpers import reference_gpt_run, train_gemini  # noqa: E402

from colossal.gemini import NonModelTracker  # noqa: E402
from colossal.testkit import random_batches  # noqa: E402


def test_tracker_counts_live_storages_once_and_skips_model_data():
    model = torch.zeros(1000)
    key = model.untyped_storage()._cdata
    with NonModelTracker(lambda k: k == key) as tracker:
        a = torch.ones(1000)  # 4000 bytes
        view = a[:10].view(2, 5)  # same storage: not counted again
        model.add_(1)  # in place on model data: not counted
        b = model * 2  # a new storage: counted
        assert tracker.current() == 8000
        del a, b
        assert tracker.current() == 4000  # the view keeps a's storage alive
        del view
        assert tracker.current() == 0
        assert tracker.peak_bytes == 8000
        with tracker.suspended():
            c = torch.ones(10)
        assert tracker.current() == 0 and c.sum() == 10


def test_warmup_trace_has_every_forward_and_backward_operator():
    batches = random_batches(2, batch=1, seq=8)
    init, _, _ = reference_gpt_run(batches[:1])
    gem, _ = train_gemini(batches, init, placement="auto", device_memory_budget=10 << 20)
    labels = [op.label for op in gem.trace.ops]
    n_modules = 20  # wte, wpe, 2 x (ln_1, q, k, v, out, ln_2, fc_in, fc_out), ln_f, lm_head
    assert len(labels) == 2 * n_modules
    assert labels[0] == "fwd:wte" and labels[n_modules - 1] == "fwd:lm_head"
    assert labels[n_modules] == "bwd:lm_head" and labels[-1] == "bwd:wte"
    assert gem.trace.ops[0].chunk_ids == gem.trace.ops[-1].chunk_ids  # tied embedding: same chunk
    peak_op = max(gem.trace.ops, key=lambda op: op.non_model_bytes)
    assert peak_op.label.startswith("bwd:") or peak_op.label == "fwd:lm_head"  # activations peak late
    assert all(op.non_model_bytes > 0 for op in gem.trace.ops)
