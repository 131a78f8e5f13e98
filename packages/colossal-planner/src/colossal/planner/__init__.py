"""colossal.planner: will it fit, and how fast? Predicted before step 1.

One traced step on the meta device (:func:`trace_model`: no weights are allocated) and each
engine's documented accounting rules give every layout's peak bytes per tier of one rank
(:func:`predict_memory`); a roofline of the traced operators plus alpha-beta communication gives
its step time (:func:`predict_step_time`); :func:`plan` ranks the layouts that fit on a
:class:`Hardware` (a preset card or node, or :func:`this_machine`, with figures from
:func:`calibrate`) and says for the others what they need and what the hardware has.
"""

from colossal.planner.calibrate import DEFAULT_PATH, Coefficients, calibrate, load_coefficients, save_coefficients
from colossal.planner.hardware import HARDWARE_PRESETS, Hardware, hardware_preset, this_machine
from colossal.planner.layout import OPTIMIZER_STATES, Layout, TierBytes
from colossal.planner.memory import MemoryPrediction, predict_memory
from colossal.planner.plan import Candidate, candidate_layouts, format_bytes, plan
from colossal.planner.speed import StepTime, comm_bytes, predict_step_time
from colossal.planner.trace import ModelTrace, ParamInfo, lm_loss, trace_model

__all__ = [
    "trace_model",
    "ModelTrace",
    "ParamInfo",
    "lm_loss",
    "Layout",
    "TierBytes",
    "OPTIMIZER_STATES",
    "MemoryPrediction",
    "predict_memory",
    "StepTime",
    "predict_step_time",
    "comm_bytes",
    "Hardware",
    "HARDWARE_PRESETS",
    "hardware_preset",
    "this_machine",
    "Coefficients",
    "calibrate",
    "load_coefficients",
    "save_coefficients",
    "DEFAULT_PATH",
    "Candidate",
    "candidate_layouts",
    "plan",
    "format_bytes",
]
