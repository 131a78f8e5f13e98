"""``tools/gpu_bench.py --device cpu --dry-run`` (#28): every row of the GPU bench runs at tiny sizes on
the CPU, so the script a GPU session spends its few minutes on is known to work before it gets there.
It checks that each row runs and prints, not what it measures (the CPU is no card)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "gpu_bench.py"


@pytest.mark.timeout(300)
def test_the_gpu_bench_dry_run_prints_every_row():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run"], capture_output=True,
                         text=True, timeout=280, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for engine in ("torch", "zero3-offload", "gemini-auto", "gemini-disk"):
        row = next(line for line in lines if line.startswith(f"| {engine} |"))
        assert "none trained" not in row and " M (" in row, row
    for model in ("gpt", "llama"):
        for engine in ("torch", "torch-compile", "fsdp2", "zero2", "gemini-roomy", "gemini-pressure"):
            row = next(line for line in lines if line.startswith(f"| {model} ") and f"| {engine} |" in line)
            assert "failed" not in row, row
            assert float(row.split("|")[3]) > 0, row  # tokens/s
    pressure = next(line for line in lines if line.startswith("| gpt ") and "| gemini-pressure |" in line)
    assert pressure.split("|")[6].strip().endswith("iB"), pressure  # the bytes moved per step under pressure
    assert any(line.startswith("skipped: needs CUDA and OPENFOLD_PATH") for line in lines)
