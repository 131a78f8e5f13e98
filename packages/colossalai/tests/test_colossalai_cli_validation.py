"""``colossalai train`` / ``run`` check every argument before spawning: one line, exit code 2,
no process started (issue 17: ``--nproc 64``, ``--tp-size 3 --nproc 1``, ``--nproc 0``)."""

import os
import subprocess
import sys
import time

import pytest
import torch

from colossalai.cli import launcher, main, validate
from colossalai.cli.main import build_parser

HYBRID = ["--plugin", "hybrid"]
BAD_TRAIN = [
    (["--nproc", "64"], "--batch-size 8 must be divisible by the data-parallel size 64"),
    ([*HYBRID, "--tp-size", "3", "--nproc", "1"], "tp 3 = 3 processes per model replica must divide the world size 1"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--tp-size", "2"], "--tp-size applies to --plugin hybrid, got --plugin gemini"),
    (["--pp-size", "2"], "--pp-size applies to --plugin hybrid, got --plugin gemini"),
    (["--plugin", "zero", "--microbatches", "4"], "--microbatches applies to --plugin hybrid"),
    (["--plugin", "gemini", "--offload"], "--offload applies to --plugin zero"),
    (["--plugin", "zero", "--placement", "static"], "--placement applies to --plugin gemini"),
    ([*HYBRID, "--tp-mode", "2d", "--tp-size", "2", "--nproc", "2"], "needs tp_size = q^2"),
    ([*HYBRID, "--tp-size", "8", "--nproc", "8", "--batch-size", "8"], "n_head 4 must be divisible by --tp-size (= 8)"),
    (
        [*HYBRID, "--tp-mode", "3d", "--tp-size", "8", "--nproc", "8", "--batch-size", "2"],
        "batch per data-parallel rank 2 must be divisible by the 3d batch blocks 4",
    ),
    (
        [*HYBRID, "--tp-size", "1", "--sp-size", "2", "--nproc", "2", "--seq-len", "33"],
        "--seq-len 33 must be divisible by --sp-size (= 2)",
    ),
    (
        [*HYBRID, "--tp-size", "1", "--sp-size", "8", "--sp-kind", "all_to_all", "--nproc", "8", "--batch-size", "8"],
        "attention heads per tensor-parallel rank 4 must be divisible by --sp-size",
    ),
    (["--plugin", "fsdp", "--precision", "fp16"], "--plugin fsdp supports --precision fp32, bf16; got fp16"),
    (["--plugin", "gemini", "--device-budget", "2XB"], "--device-budget must look like '64MiB', '2GiB', '512MB'"),
    (["--plugin", "gemini", "--device-budget", "0"], "--device-budget must be a positive byte count, got '0'"),
    (["--corpus-bytes", "100"], "--corpus-bytes 100 holds 1 windows of 64 tokens"),
    (["--vocab-size", "100"], "--vocab-size must be >= 256 (256: plain bytes), got 100"),
    ([*HYBRID, "--nproc", "2", "--vocab-size", "1001"], "vocab_size 1001 must be divisible by --tp-size (= 2)"),
    (["--resume", "/no/such/checkpoint"], "--resume /no/such/checkpoint: no such checkpoint folder"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--sample-tokens", "-3"], "--sample-tokens must be >= 0, got -3"),
    (["--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
    (["--profile-skip", "-1"], "--profile-skip must be >= 0, got -1"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--sample-temperature", "-0.5"], "--sample-temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    (["--sample-top-k", "-1"], "--sample-top-k must be >= 0 (0: all), got -1"),
    (["--grad-clip", "-1"], "--grad-clip must be a finite number >= 0"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    ([*HYBRID, "--ep-size", "2", "--nproc", "2"], "--ep-size 2 needs a model with experts (--model moe-gpt)"),
    (["--ep-size", "2"], "--ep-size applies to --plugin hybrid, got --plugin gemini"),
    (
        ["--model", "moe-gpt", *HYBRID, "--ep-size", "4", "--nproc", "2"],
        "--ep-size 4 must divide the data-parallel size 2",
    ),
    (
        ["--model", "moe-gpt", "--preset", "moe-tiny", *HYBRID, "--ep-size", "8", "--nproc", "8", "--batch-size", "8"],
        "MoE GPT moe-tiny: num_experts 4 must be divisible by --ep-size 8",
    ),
    (
        ["--model", "moe-gpt", *HYBRID, "--ep-size", "2", "--sp-size", "2", "--nproc", "4"],
        "--ep-size 2 with --sp-size 2: the MoE GPT's capacity and aux loss are per rank, i.e. per sequence chunk",
    ),
    (["--model", "moe-gpt", "--preset", "tiny"], "--preset tiny is not a --model moe-gpt preset"),
    (["--preset", "moe-tiny"], "--preset moe-tiny is not a --model gpt preset"),
    (
        [*HYBRID, "--pp-size", "4", "--nproc", "4", "--preset", "tiny"],
        "GPT tiny: n_layer 2 must be divisible by --pp-size x --pp-virtual 4 x 1 (= 4)",
    ),
    (
        [*HYBRID, "--pp-size", "2", "--microbatches", "3", "--nproc", "2"],
        "batch per data-parallel rank 8 must be divisible by --microbatches (= 3)",
    ),
]


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if anything would start a process."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(launcher.subprocess, "call", refuse)
    monkeypatch.setattr(launcher.subprocess, "Popen", refuse)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


@pytest.mark.parametrize(("argv", "message"), BAD_TRAIN, ids=[" ".join(a) for a, _ in BAD_TRAIN])
def test_bad_train_argument_is_one_line_and_exit_code_2(argv, message, no_spawn, capsys):
    try:
        code = main(["train", *argv])
    except SystemExit as exc:  # argparse's own checks (choices, types)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("colossalai train: error: "), err
    assert message in err, err


def test_bad_file_paths(tmp_path, no_spawn, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["train", "--export", str(tmp_path / "f")]) == 2
    assert f"--export {tmp_path / 'f'}: exists and is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0", "x.py"], "--nproc must be >= 1, got 0"),
        (["/no/such/script.py"], "script /no/such/script.py does not exist"),
        ([], "needs a script to run"),
        (["--hostfile", "/no/such/hosts", "x.py"], "--hostfile /no/such/hosts: no such file"),
        (["--master-port", "70000", "x.py"], "--master-port must lie in [1, 65535]"),
        (["--max-restarts", "-1", "x.py"], "--max-restarts must be >= 0, got -1"),
    ],
)
def test_bad_run_argument_is_one_line_and_exit_code_2(argv, message, no_spawn, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("colossalai run: error: ") and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs, more processes than devices is an error")
def test_more_processes_than_cores_warns(monkeypatch):
    monkeypatch.setattr(validate, "usable_cores", lambda: 1)
    parser = build_parser()
    args = parser.parse_args(["train", "--nproc", "2"])
    (warning,) = validate.validate_train(args)
    assert warning.startswith("--nproc 2 exceeds the 1 usable CPU core(s)")


def test_good_layouts_pass():
    parser = build_parser()
    for argv in (
        ["--plugin", "hybrid", "--tp-mode", "2d", "--tp-size", "4", "--nproc", "4"],
        ["--plugin", "hybrid", "--tp-mode", "2.5d", "--tp-size", "8", "--tp-depth", "2", "--nproc", "8"],
        ["--plugin", "hybrid", "--tp-size", "2", "--sp-size", "2", "--sp-kind", "all_to_all", "--nproc", "8"],
        ["--plugin", "zero", "--zero-stage", "3", "--offload", "--nproc", "2"],
        ["--plugin", "gemini", "--device-budget", "2.5MiB", "--placement", "static"],
        ["--model", "moe-gpt", "--plugin", "hybrid", "--ep-size", "2", "--nproc", "4"],
        ["--plugin", "hybrid", "--pp-size", "2", "--microbatches", "4", "--nproc", "2"],
    ):
        args = parser.parse_args(["train", *argv])
        validate.validate_train(args)  # no UsageError


def test_entry_point_exits_2_at_once_without_spawning():
    """Through the real entry point: ``--nproc 64`` answers in seconds (it used to spawn 64 ranks
    and fail after two minutes), on one line of stderr, with nothing on stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "colossalai.cli", "train", "--nproc", "64"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and proc.stdout == "", proc
    expected = "--batch-size 8 must be divisible by the data-parallel size 64 (world 64 / 1 per replica)"
    assert proc.stderr.splitlines() == [f"colossalai train: error: {expected}"]
    assert time.perf_counter() - start < 60  # import time only (a few seconds idle), no ranks


def test_profile_window_fits_a_short_run():
    import argparse

    from colossalai.cli.train import profile_window

    args = argparse.Namespace(profile_skip=2, profile_steps=3)
    assert profile_window(args, 10) == (2, 3)
    assert profile_window(args, 4) == (2, 2)
    assert profile_window(args, 2) == (1, 1)  # still records the run's last step
    assert profile_window(args, 1) == (0, 1)
