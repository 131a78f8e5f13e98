"""Inference of the Evoformer trunk with DAP and chunking options, reporting time and peak memory;
``python -m fastfold.inference --help`` is the command line.

[Note: how memory is measured]
Each rank is a fresh process. After the model and features are in memory the RSS high-water mark
is reset (Linux ``clear_refs``), so ``peak_rss`` is the high-water mark during the forward and
``activation`` = ``peak_rss`` - RSS just before it: the transient memory of the trunk. On CUDA the
allocator's peak is reported as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import torch

from fastfold.config import EvoformerConfig
from fastfold.memory import current_rss_bytes, peak_device_bytes, peak_rss_bytes, reset_peak_memory, reset_peak_rss
from fastfold.model import EvoformerStack

__all__ = ["TrunkSpec", "TrunkResult", "run_evoformer", "run_trunk", "spawn_ranks", "main"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class TrunkSpec:
    """What :func:`run_trunk` runs: a model (random or loaded), features (random or loaded), options."""

    n_seq: int = 16
    """MSA sequences of the random features."""
    n_res: int = 256
    """Residues of the random features."""
    blocks: int = 2
    """Evoformer blocks."""
    c_m: int = 256
    """MSA channels (AlphaFold: 256)."""
    c_z: int = 128
    """Pair channels (AlphaFold: 128)."""
    chunk_size: int | None = None
    """Chunk size of every operator (``None``: unchunked)."""
    inplace: bool = False
    """Add updates into the residual stream in place (lower peak memory)."""
    max_memory_mib: int | None = None
    """Activation memory allowed per rank (MiB): the chunk size is chosen from it (instead of
    ``chunk_size``; see :func:`fastfold.autochunk.choose_chunk_size`)."""
    dap_size: int = 1
    """Ranks of the DAP group (local processes)."""
    threads: int | None = None
    """Torch threads per rank (default: CPU count // dap_size)."""
    repeats: int = 1
    """Timed forwards (the fastest is reported) after one untimed warm-up when > 1."""
    seed: int = 0
    """Seed of the random weights and features."""
    weights: str | None = None
    """OpenFold ``state_dict`` (``.pt``) or AlphaFold ``.npz`` to load instead of random weights."""
    features: str | None = None
    """``torch.save``'d dict with ``m``, ``z`` and optional ``msa_mask``, ``pair_mask``."""
    dtype: str = "float32"
    """Compute dtype: float32, float64 or bfloat16."""
    no_overlap: bool = False
    """Run DAP's collectives synchronously (``Dap(overlap=False)``; same results) to measure or
    debug the communication/compute overlap."""

    def __post_init__(self) -> None:
        for name in ("n_seq", "n_res", "blocks", "c_m", "c_z", "dap_size", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrunkSpec.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"TrunkSpec.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.dap_size > self.n_res and self.features is None:
            raise ValueError(f"dap_size {self.dap_size} is larger than the number of residues {self.n_res}")


@dataclass(kw_only=True, slots=True)
class TrunkResult:
    """One rank's measurements."""

    rank: int
    """Rank in the DAP group."""
    seconds: float
    """Wall time of the forward (fastest of the repeats)."""
    peak_rss_bytes: int
    """Host RSS high-water mark during the forward."""
    activation_bytes: int
    """``peak_rss_bytes`` minus the RSS just before the forward."""
    peak_device_bytes: int
    """CUDA allocator peak on the model's device over the timed repeats (0 on CPU)."""
    cpu_seconds: float = 0.0
    """Process CPU time (all of the rank's threads, communication included) over the same span as
    ``seconds``."""


def run_evoformer(
    model, m, z, msa_mask=None, pair_mask=None, *, chunk_size=None, inplace=False, dap=None, max_memory=None
):
    """One timed inference forward; returns ``((m, z, s), seconds, peak_rss_bytes, activation_bytes)``.

    Resets the host RSS high-water mark but never the CUDA peak statistics (a caller's measurement
    survives; see [Note: no reset of a caller's CUDA peak] in :mod:`fastfold.memory`)."""
    with torch.inference_mode():
        reset_peak_rss()
        base = current_rss_bytes()
        start = time.perf_counter()
        kw = {} if max_memory is None else {"max_memory": max_memory}
        out = model(m, z, msa_mask, pair_mask, chunk_size=chunk_size, inplace=inplace, dap=dap, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = peak_rss_bytes()
    return out, seconds, peak, max(peak - base, 0)


def _load(spec: TrunkSpec, device: torch.device):
    torch.manual_seed(spec.seed)
    cfg = EvoformerConfig(c_m=spec.c_m, c_z=spec.c_z, no_blocks=spec.blocks, msa_dropout=0.0, pair_dropout=0.0)
    model = EvoformerStack(cfg).eval()
    if spec.weights:
        from fastfold.weights import load_alphafold_params, load_openfold_state_dict

        if spec.weights.endswith(".npz"):
            import numpy as np

            load_alphafold_params(model, dict(np.load(spec.weights)))
        else:
            load_openfold_state_dict(model, torch.load(spec.weights, map_location="cpu"))
    dt = _DTYPES[spec.dtype]
    if spec.features:
        feats = torch.load(spec.features, map_location="cpu")
    else:
        feats = {"m": torch.randn(spec.n_seq, spec.n_res, spec.c_m), "z": torch.randn(spec.n_res, spec.n_res, spec.c_z)}
    feats = {k: v.to(device=device, dtype=dt) for k, v in feats.items()}
    return model.to(device=device, dtype=dt), feats


def _rank_main(spec: TrunkSpec) -> TrunkResult:
    from colossal.comm import default_device
    from fastfold.parallel import Dap

    torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // spec.dap_size))
    device = default_device()
    model, feats = _load(spec, device)
    dap = Dap(overlap=not spec.no_overlap) if spec.dap_size > 1 else None
    args = (feats["m"], feats["z"], feats.get("msa_mask"), feats.get("pair_mask"))
    max_memory = None if spec.max_memory_mib is None else spec.max_memory_mib * 2**20
    kw = dict(chunk_size=spec.chunk_size, inplace=spec.inplace, dap=dap, max_memory=max_memory)
    if spec.repeats > 1:
        run_evoformer(model, *args, **kw)
    runs = []
    reset_peak_memory(model)  # this rank's own fresh process: nobody else's peak to keep
    for _ in range(spec.repeats):
        cpu_start = time.process_time()
        runs.append((*run_evoformer(model, *args, **kw)[1:], time.process_time() - cpu_start))
    seconds, cpu = min(r[0] for r in runs), min(r[3] for r in runs)
    peak, act = max(r[1] for r in runs), max(r[2] for r in runs)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return TrunkResult(
        rank=rank,
        seconds=seconds,
        peak_rss_bytes=peak,
        activation_bytes=act,
        peak_device_bytes=peak_device_bytes(model),
        cpu_seconds=cpu,
    )


def run_trunk(spec: TrunkSpec, timeout: float = 3600.0) -> list[TrunkResult]:
    """Run ``spec`` on ``spec.dap_size`` fresh local processes; one :class:`TrunkResult` per rank."""
    return spawn_ranks(_rank_main, spec, timeout=timeout)


def spawn_ranks(fn, spec: TrunkSpec, *args, timeout: float = 3600.0) -> list:
    """Run module-level ``fn(spec, *args)`` on ``spec.dap_size`` fresh local processes (NCCL, one
    GPU per rank, with CUDA; gloo on CPU)."""
    from colossal.comm import default_backend
    from colossal.comm.testing import run_distributed

    threads = spec.threads or max(1, (os.cpu_count() or 1) // spec.dap_size)
    # Large buffers go straight to mmap and back to the OS on free, so RSS tracks live tensors
    # (glibc's adaptive threshold would otherwise keep freed activations in the heap). Takes
    # effect for the worker processes started after this point.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))
    return run_distributed(fn, spec.dap_size, spec, *args, timeout=timeout, threads=threads, backend=default_backend())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastfold.inference", description=__doc__.split("\n")[0])
    for f in dataclasses.fields(TrunkSpec):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            p.add_argument(flag, action="store_true", help=f"{f.name} (default off)")
        else:
            kind = {"int": int, "int | None": int, "str | None": str, "str": str}[f.type]
            p.add_argument(flag, type=kind, default=f.default, help=f"default {f.default}")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def main(argv: list[str] | None = None) -> list[TrunkResult]:
    """Command-line entry: parse, run, print one line per rank (or JSON)."""
    args = vars(_parser().parse_args(argv))
    as_json = args.pop("json")
    spec = TrunkSpec(**args)
    results = run_trunk(spec)
    if as_json:
        print(json.dumps({"spec": dataclasses.asdict(spec), "ranks": [dataclasses.asdict(r) for r in results]}))
    else:
        for r in results:
            print(
                f"rank {r.rank}: {r.seconds:.3f} s, peak RSS {r.peak_rss_bytes / 2**20:.1f} MiB, "
                f"activations {r.activation_bytes / 2**20:.1f} MiB, device peak {r.peak_device_bytes / 2**20:.1f} MiB"
            )
    return results


if __name__ == "__main__":
    main()
