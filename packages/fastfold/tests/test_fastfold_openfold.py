"""fastfold against OpenFold itself (github.com/aqlaboratory/openfold), both in float64: the same
random weights (exported through the OpenFold name mapping, loaded strictly), the same inputs with
masked keys, outputs of the inference forward and parameter gradients of the checkpointed training
forward. In float64 no ReLU pre-activation lies within rounding of its kink, so the two must agree
to float64 round-off; tolerance 1e-10 of the largest entry (measured: 1.2e-15 to 2.1e-15 over 10
seeds), far below any real difference (shifting one bias entry of OpenFold's last pair transition
by 1e-6 gives 1.9e-7).

OpenFold is not a registry package: the test needs ``OPENFOLD_PATH`` pointing at a source tree (and
``numpy scipy ml_collections einops dm-tree``) and is skipped with a message without it. It runs in
a fresh process through ``bench/bench_openfold.py``, which supplies the stand-in for OpenFold's CUDA
extension, so OpenFold's modules never enter the test process."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_openfold.py"
TOL = 1e-10


def _openfold_env():
    path = os.environ.get("OPENFOLD_PATH")
    if not path or not (pathlib.Path(path) / "openfold").is_dir():
        pytest.skip("OPENFOLD_PATH is not set to an OpenFold source tree (github.com/aqlaboratory/openfold)")
    spec = importlib.util.spec_from_file_location("_fastfold_bench_openfold", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench._env(threads=1)


def test_float64_outputs_and_gradients_equal_openfold():
    env = _openfold_env()
    code = (
        f"import sys, json; sys.path.insert(0, {str(BENCH.parent)!r}); import bench_openfold as b; "
        "print(json.dumps([b.check_float64(n_seq=4, n_res=16, seed=s, float32=False) for s in (1, 2)]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for seed, row in zip((1, 2), rows):
        assert set(row) == {
            "float64 outputs, fastfold vs OpenFold",
            "float64 gradients, fastfold vs OpenFold (checkpointed)",
        }
        for name, value in row.items():
            assert value < TOL, f"seed {seed}: {name} = {value:.3g}"
