"""What ``colossalai train`` says about capacity: model states against the device budget, and the
bytes Gemini moved between its tiers to train within it.

[Note: the default device budget]
``colossalai train`` shows what the project is for: Gemini training a model whose states (fp32
parameters, gradients and Adam moments; 16 bytes per parameter in fp32) exceed the device budget.
Without ``--device-budget`` the budget is :data:`DEFAULT_BUDGET_FRACTION` of the model states one
process holds, on every machine: on CUDA it is enforced on the real card, on a CPU-only machine by
accounting (the device tier is then CPU memory, and every move is a real copy, see ``[Note:
CPU-only runs]`` in ``colossal.gemini.tiers``). The budget also holds activations (non-model data),
which for a small GPT are of the same order as its states; with activation checkpointing (the
Gemini default) the default run fits 0.65 x its states, so the placement moves chunks every step.
Its largest activations are the logits over the 1024-id vocabulary and the criterion's softmax; it
fits because ``Booster.execute_pipeline`` releases the logits before backward (with them held, the
first step needed 10.5 MB against a 9.7 MB budget).
A larger batch needs a larger budget: Gemini then fails at warm-up with "need X bytes ... budget Y".
"""

from __future__ import annotations

from colossalai.cli.meters import format_bytes

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "model_state_bytes",
    "lora_state_bytes",
    "working_bytes",
    "default_device_budget",
    "headline",
    "tier_rows",
]

DEFAULT_BUDGET_FRACTION = 0.65
"""Device budget of ``colossalai train --plugin gemini`` without ``--device-budget``, as a fraction of
the model states per process (see ``[Note: the default device budget]``)."""

_WORKING_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def model_state_bytes(num_parameters: int, precision: str, shards: int = 1) -> int:
    """Bytes of model states per process: working parameters and gradients, the fp32 master copy
    under mixed precision, and Adam's two fp32 moments, split over ``shards`` processes."""
    if precision not in _WORKING_BYTES:
        raise ValueError(f"precision must be one of {sorted(_WORKING_BYTES)}, got {precision!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    w = _WORKING_BYTES[precision]
    per_param = 2 * w + (4 if w != 4 else 0) + 8  # param + grad (+ fp32 master) + exp_avg + exp_avg_sq
    return num_parameters * per_param // shards


def working_bytes(precision: str) -> int:
    """Bytes per element of the working parameters under ``precision`` (fp32 4, fp16/bf16 2)."""
    if precision not in _WORKING_BYTES:
        raise ValueError(f"precision must be one of {sorted(_WORKING_BYTES)}, got {precision!r}")
    return _WORKING_BYTES[precision]


def lora_state_bytes(frozen: int, trainable: int, precision: str, shards: int = 1) -> int:
    """Bytes of model states per process when only ``trainable`` parameters train: the frozen
    ones in working precision alone (no gradient, master or moments), the trainable ones as
    :func:`model_state_bytes` counts them, split over ``shards`` processes."""
    return (frozen * working_bytes(precision) + model_state_bytes(trainable, precision)) // shards


def default_device_budget(num_parameters: int, precision: str, shards: int = 1) -> int:
    """The default Gemini device budget: :data:`DEFAULT_BUDGET_FRACTION` of the model states per process."""
    return int(model_state_bytes(num_parameters, precision, shards) * DEFAULT_BUDGET_FRACTION)


def headline(states: int, budget: int, device: str) -> str:
    """'model states 12.9 MiB = 1.7 x the device budget (7.7 MiB on cpu, accounted)'."""
    where = "cpu, accounted" if device == "cpu" else device
    ratio = states / budget
    shown = f"{ratio:.1f}" if ratio >= 1 else f"{ratio:.2f}"
    return f"model states {format_bytes(states)} = {shown} x the device budget ({format_bytes(budget)} on {where})"


def tier_rows(history: list, train_seconds: float) -> dict[str, str]:
    """Summary rows from Gemini's per-step statistics (``GeminiDDP.stats_history``): bytes moved per
    tier pair in all and per step after warm-up, the offline optimum of the traced order, and the
    share of the training time spent copying."""
    if not history:
        return {}
    steady = [s for s in history if s.policy != "warmup"] or history
    n = len(steady)
    rows = {
        "host -> device": f"{format_bytes(sum(s.bytes_to_device for s in history))} "
        f"({format_bytes(sum(s.bytes_to_device for s in steady) / n)}/step)",
        "device -> host": f"{format_bytes(sum(s.bytes_to_host for s in history))} "
        f"({format_bytes(sum(s.bytes_to_host for s in steady) / n)}/step)",
    }
    belady = [s.belady_bytes for s in steady if s.belady_bytes is not None]
    if belady:
        rows["offline optimum"] = f"{format_bytes(sum(belady) / len(belady))}/step (Belady on the traced order)"
    copy = sum(s.transfer_seconds for s in history)
    rows["time copying"] = f"{copy:.1f} s ({100 * copy / max(train_seconds, 1e-9):.0f}% of training)"
    rows["device peak"] = f"{format_bytes(max(s.peak_device_bytes for s in history))} (model + activations)"
    return rows
