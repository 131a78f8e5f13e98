"""Options of ``colossalai train``."""

from __future__ import annotations

import argparse

from colossal.comm.knobs import as_bytes
from colossalai.booster.registry import PLUGINS
from colossalai.models import MODELS

__all__ = [
    "add_train_arguments",
    "STEPS",
    "SEQ_LEN",
    "VOCAB_SIZE",
    "CORPUS_BYTES",
    "SAMPLE_TEMPERATURE",
    "SAMPLE_TOP_K",
    "DEBUG_HELP",
    "seq_len_of",
]

STEPS = 1200
"""Default optimizer steps: enough for the default GPT (mini, Gemini, batch 8 x 64 tokens of the
1024-id BPE, peak rate 3e-3) to write text that looks like Python (real keywords, mostly real names:
``elif not isinstance(other, other._exp) and self._exp is None:``), in under three CPU minutes."""

SEQ_LEN = 64
"""Default tokens per sequence (or the preset's block size when smaller): about 180 bytes of text with
the default BPE. For the CPU-sized presets short windows learn faster per token than long ones (byte
vocabulary, same tokens per step: 8 x 64 reached a loss of 2.19 after 400 steps where 4 x 128 was at
2.38)."""


VOCAB_SIZE = 1024
"""Default vocabulary: a byte-level BPE of 1024 ids learned from the corpus (``[Note: why a learned
subword vocabulary]`` in ``colossalai.data.tokenizer``); 256 trains on plain bytes."""

CORPUS_BYTES = 2_000_000
"""Default bytes of the embedded corpus: at ~3 bytes per BPE token the default run sees it about once."""

SAMPLE_TEMPERATURE = 0.6
"""Default temperature of the sample at the end. Chosen with the byte vocabulary (loss ~1.5-1.8 per
byte): at 0.8 / top-k 20 a byte model broke most names, at 0.6 / top-k 10 its lines read as Python;
a lower temperature risks a long run of the likeliest token (spaces at an indent), and 1.0 / top-k 3
drifted into docstring prose. With the default BPE, 0.6 / top-k 10 gives indented Python with real
keywords and mostly real names."""

DEBUG_HELP = "on a failure, print the full traceback and keep every rank's traceback file"
"""Help of ``--debug`` (``train`` and ``run``): without it a failure is one line and the per-rank
traceback files are removed when the run ends ([Note: reporting rank failures once])."""

SAMPLE_TOP_K = 10
"""Default top-k of the sample at the end: tokens outside the model's ten likeliest are never drawn."""


def add_train_arguments(p: argparse.ArgumentParser, *, with_model: bool = True) -> None:
    """Register every ``train`` option on ``p`` (``with_model=False``: all but ``--model``,
    ``--preset`` and ``--vocab-size``, which ``finetune`` takes from its base)."""
    p.add_argument("--plugin", default="gemini", choices=sorted(PLUGINS), help="parallel layout (default gemini)")
    if with_model:
        p.add_argument("--model", default="gpt", choices=list(MODELS), help="model family (default gpt)")
        presets = [name for family in MODELS.values() for name in family.presets]
        p.add_argument(
            "--preset",
            default=None,
            choices=presets,
            help="model size (default: the family's mini preset, ~1M parameters)",
        )
    p.add_argument("--nproc", type=int, default=1, help="processes on this host (relaunches through torchrun)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"], help="mixed precision")
    p.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps in total (default {STEPS})")
    p.add_argument("--batch-size", type=int, default=8, help="global batch size in sequences (default 8)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence (default {SEQ_LEN}, or the preset's block size when smaller)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps before cosine decay (default 100)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip gradient norm to this (0: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--corpus", default=None, help="text file or folder of text files to train on (default: the embedded one)"
    )
    p.add_argument(
        "--corpus-bytes",
        type=int,
        default=CORPUS_BYTES,
        help=f"bytes of the corpus to use (default {CORPUS_BYTES}: the default run sees the embedded one about once)",
    )
    if with_model:
        p.add_argument(
            "--vocab-size",
            type=int,
            default=VOCAB_SIZE,
            help=f"token ids: a byte-level BPE learned from the corpus (default {VOCAB_SIZE}; 256: plain bytes)",
        )
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in backward (default: on with gemini, whose budget holds them; off otherwise)",
    )
    p.add_argument(
        "--device-budget",
        type=str,
        default=None,
        help="device memory budget per process, e.g. 2GiB (gemini; default 0.65 x the model states per process)",
    )
    p.add_argument("--placement", default="auto", choices=["auto", "static"], help="gemini chunk placement")
    p.add_argument("--disk-dir", default=None, help="gemini: spill model states to files in this directory")
    p.add_argument(
        "--host-budget",
        default=None,
        help="gemini with --disk-dir: host memory Gemini may use, e.g. 8GiB (auto placement)",
    )
    p.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage (zero)")
    p.add_argument(
        "--tp-size", type=int, default=None, help="tensor-parallel degree (hybrid; default 2, 1 with --sp-size)"
    )
    p.add_argument("--tp-mode", default="1d", choices=["1d", "2d", "2.5d", "3d"], help="tensor-parallel mode (hybrid)")
    p.add_argument("--tp-depth", type=int, default=1, help="2.5D depth d (hybrid, --tp-mode 2.5d)")
    p.add_argument("--sp-size", type=int, default=1, help="sequence-parallel degree (hybrid)")
    p.add_argument("--sp-kind", default="ring", choices=["ring", "all_to_all"], help="sequence-parallel attention")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (hybrid)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (hybrid; default pp-size)")
    p.add_argument(
        "--pp-schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved", "zero_bubble"],
        help="pipeline schedule",
    )
    p.add_argument("--pp-virtual", type=int, default=1, help="chunks per pipeline rank (hybrid, interleaved)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel degree (hybrid, --model moe-gpt)")
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer states on the CPU (zero)")
    p.add_argument("--save-dir", default=None, help="checkpoint root (step-N folders + 'latest')")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", default=None, help="checkpoint (or checkpoint root) to resume from exactly")
    p.add_argument("--export", default=None, help="write a safetensors folder of the final model here")
    p.add_argument("--profile", default=None, metavar="DIR", help="colossal.profiler traces and tables into DIR")
    p.add_argument(
        "--profile-skip",
        type=int,
        default=2,
        metavar="N",
        help="--profile: steps run before recording (the engines' warm-up; default 2)",
    )
    p.add_argument("--profile-steps", type=int, default=3, metavar="N", help="--profile: steps recorded (default 3)")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="TensorBoard scalars into DIR")
    p.add_argument("--progress", default="auto", choices=["auto", "rich", "plain"], help="progress display")
    p.add_argument("--log-every", type=int, default=10, help="plain progress: print every N steps")
    p.add_argument("--sample-tokens", type=int, default=300, help="tokens of the generated sample at the end")
    p.add_argument(
        "--sample-temperature",
        type=float,
        default=SAMPLE_TEMPERATURE,
        help=f"sampling temperature of the sample (default {SAMPLE_TEMPERATURE}; 0: greedy)",
    )
    p.add_argument(
        "--sample-top-k",
        type=int,
        default=SAMPLE_TOP_K,
        help=f"sample among the k likeliest tokens only (default {SAMPLE_TOP_K}; 0: all)",
    )
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)


def seq_len_of(args: argparse.Namespace, block_size: int) -> int:
    """Tokens per sequence of a run: ``--seq-len``, else :data:`SEQ_LEN` capped by the preset's ``block_size``."""
    return args.seq_len or min(SEQ_LEN, block_size)


def parse_bytes(text: str | None, flag: str = "--device-budget") -> int | None:
    """'2GiB' / '512MB' / '1e9' -> bytes, as every Python API reads a budget (``colossal.comm.as_bytes``)."""
    return None if text is None else as_bytes(text, flag)
