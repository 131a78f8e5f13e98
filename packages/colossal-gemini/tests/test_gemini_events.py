"""Events: chunk moves and memory samples reach observers and add up to the per-step statistics."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemini_helpers import reference_gpt_run, train_gemini  # noqa: E402

import colossal.gemini as gemini  # noqa: E402
from colossal.testkit import random_batches  # noqa: E402


def test_observers_see_moves_and_samples_matching_stats():
    batches = random_batches(3, batch=1, seq=8)
    init, _, _ = reference_gpt_run(batches[:1])
    seen = []
    with gemini.register_observer(seen.append):
        gem, _ = train_gemini(batches, init, placement="auto", device_memory_budget=200_000)
    moves = [e for e in seen if e.kind == "chunk_move"]
    samples = [e for e in seen if e.kind == "memory_sample"]
    assert moves and samples
    assert sum(e.nbytes for e in moves) == sum(s.bytes_moved for s in gem.stats_history)
    assert {e.reason for e in moves} >= {"fetch", "evict", "grad_offload"}
    assert all(e.end >= e.start and e.src in ("cpu", "cuda") for e in moves)
    assert max(s.model_bytes + s.non_model_bytes for s in samples[len(samples) // 2 :]) <= 200_000
    n = len(seen)
    train_gemini(batches[:1], init, placement="auto", device_memory_budget=200_000)
    assert len(seen) == n  # removed on leaving the with-block
