"""Command-line errors in the command line's words: an unknown flag gets the closest flag (or, for
torchrun's spellings, ours) with exit code 2 on every sub-command; an engine's budget or setup
error under ``colossalai train`` is one line naming the CLI flags, not a traceback naming Python
arguments."""

import argparse
import os
import subprocess
import sys

import pytest

from colossal.gemini import BudgetExceededError
from colossalai.cli.main import main
from colossalai.cli.user_errors import cli_message


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--devce-budget", "1KiB"], "; did you mean --device-budget? (see colossalai train --help)"),
        (["train", "--batch_size", "4"], "; did you mean --batch-size?"),
        (["train", "--nproc_per_node", "2"], "is torchrun's spelling: colossalai train calls it --nproc"),
        (["train", "--nproc-per-node=2"], "colossalai train calls it --nproc"),
        (["train", "--master_port", "29501"], "colossalai train --nproc N needs no port"),
        (["train", "--nnodes", "2"], "colossalai train runs on this host only (--nproc N)"),
        (["run", "--nprc", "2", "x.py"], "run: error: unrecognized arguments: --nprc; did you mean --nproc?"),
        (["run", "--nproc_per_node", "2", "x.py"], "did you mean --nproc-per-node?"),
        (["run", "--master_port", "1", "x.py"], "did you mean --master-port?"),
        (["run", "--master-addr", "h", "x.py"], "colossalai run takes the hosts from --hostfile FILE"),
        (["run", "--node_rank", "1", "x.py"], "--node_rank is torchrun's spelling"),
        (["check", "--verbose"], "colossalai check: error: unrecognized arguments: --verbose (see colossalai check"),
    ],
)
def test_unknown_flag_gets_a_hint(capsys, argv, hint):
    assert hint in _usage_error(capsys, *argv)


def test_budget_error_is_one_line_naming_the_flag(tmp_path):
    argv = ["train", "--plugin", "gemini", "--device-budget", "1KiB", "--preset", "tiny", "--steps", "2"]
    argv += ["--seq-len", "32", "--corpus-bytes", "100000", "--progress", "plain", "--sample-tokens", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "colossalai.cli", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("colossalai train: error: --device-budget 1KiB is too small: need "), lines
    assert " KiB more (" in lines[0] and "raise --device-budget to at least " in lines[0], lines
    assert "chunk_size" not in lines[0] and "device_memory_budget" not in lines[0], lines


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"device_budget": None, "activation_checkpointing": None, **given})


def test_budget_advice_keeps_only_what_the_cli_can_set():
    exc = BudgetExceededError(
        "static placement: need 3145728 bytes on the device at operator 4 (fwd:wte), budget 1048576; "
        "raise offload_param_frac (now 0.0) or offload_optim_frac (now 0.0), or use placement='auto'"
    )
    assert cli_message(exc, _args(device_budget="1MiB")) == (
        "--device-budget 1MiB is too small: need 2.0 MiB more (static placement: 3.0 MiB on the device at "
        "operator 4 (fwd:wte), budget 1.0 MiB); raise --device-budget to at least 3.0 MiB or use --placement auto"
    )
    exc = BudgetExceededError(
        "need 2048 bytes on the device at operator fwd:wte (model 1024, non-model 1024 measured in warm-up), "
        "budget 1024; raise device_memory_budget, lower prefetch (now 2; 0 gathers on demand), lower chunk_size "
        "(now 64 elements) or lower the batch size (activations are measured in this first step)"
    )
    message = cli_message(exc, _args(activation_checkpointing=False))
    assert message.startswith("the default device budget is too small: need 1.0 KiB more (2.0 KiB on the device")
    assert "(model 1.0 KiB, non-model 1.0 KiB" in message and "prefetch" not in message and "chunk" not in message
    assert message.endswith(
        "raise --device-budget to at least 2.0 KiB, lower --batch-size (activations are measured in this first "
        "step) or drop --no-activation-checkpointing (activations count in the budget)"
    )


def test_setup_errors_name_flags_and_bugs_keep_their_traceback():
    exc = ValueError("num_microbatches must be a positive int, got 0; tp_size 3 does not divide\n 4")
    assert cli_message(exc, _args()) == "--microbatches must be a positive int, got 0; --tp-size 3 does not divide 4"
    assert cli_message(NotImplementedError("mixed_precision fp8"), _args()) == "--precision fp8"
    assert cli_message(KeyError("tp_size"), _args()) is None
    assert cli_message(BudgetExceededError("host tier: need 1 bytes, budget 0; x"), _args()) is None
