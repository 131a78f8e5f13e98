"""End-to-end ``colossalai`` CLI runs (subprocesses, few steps): progress output, TensorBoard log,
checkpoints, exact resume (also under another plugin and world size), ``run`` and ``check``."""

import os
import re
import subprocess
import sys

import pytest

# The tiny, fast configuration, every size explicit (the defaults train the demo model for minutes).
TRAIN = ["train", "--plugin", "ddp", "--preset", "tiny", "--seq-len", "32", "--batch-size", "8"]
TRAIN += ["--corpus-bytes", "100000", "--lr", "3e-3"]
TRAIN += ["--progress", "plain", "--log-every", "1", "--sample-tokens", "8", "--warmup", "2"]


def _cli(*args, cwd=None, timeout=240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "colossalai.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def _losses(out: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/\d+ loss ([0-9.]+)", out)}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    out = _cli(*TRAIN, "--steps", "6", "--save-every", "3", "--save-dir", str(root / "ckpt"), "--tensorboard",
               str(root / "tb"), "--profile", str(root / "prof"))  # fmt: skip
    return root, out


def test_train_shows_progress_summary_sample_and_falling_loss(first_run):
    _, out = first_run
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1]
    for column in ("tok/s", "mem[cpu=", "comm ", "tier-moves ", "eta"):
        assert column in out
    assert "colossalai train" in out and "tokens/s" in out and "sample:" in out
    assert "communicated" in out and "moved between tiers" in out and "\ufffd" not in out


def test_train_profile_records_steady_steps_under_the_users_names(first_run):
    """#31 item 8: --profile recorded only the warm-up step; now --profile-skip 2, --profile-steps 3."""
    import json

    root, out = first_run
    lines = [json.loads(line) for line in (root / "prof" / "summary.rank0.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 3, 4]  # 0-based: the 3rd to 5th training steps
    names = set(lines[0]["modules"])
    assert names and not any(n.startswith("module") for n in names), names  # the model's own paths
    assert "profile" in out and "(steps 3-5;" in out


def test_train_writes_tensorboard_and_checkpoints(first_run):
    root, _ = first_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    ckpt = root / "ckpt"
    assert (ckpt / "step-00000003" / "dcp" / ".metadata").is_file()
    assert (ckpt / "latest").read_text().strip() == "step-00000006"


def test_resume_is_exact(first_run, tmp_path):
    root, out = first_run
    resumed = _cli(*TRAIN, "--steps", "6", "--resume", str(root / "ckpt" / "step-00000003"))
    got, ref = _losses(resumed), _losses(out)
    assert sorted(got) == [4, 5, 6]
    assert all(got[s] == ref[s] for s in got), (got, ref)


def test_checkpoint_keeps_the_tokenizer_and_resume_checks_it(first_run):
    """The run state holds the BPE the model learned with (resume and samples decode with it, not
    with one learned again); resuming under another ``--vocab-size`` fails, naming both."""
    import torch

    from colossalai.data import CorpusTokenizer, load_corpus

    root, _ = first_run
    ckpt = root / "ckpt" / "step-00000003"
    saved = torch.load(ckpt / "run_state.pt", weights_only=False)["run"]["extra"]["tokenizer"]
    assert CorpusTokenizer.from_json(saved) == CorpusTokenizer.train(load_corpus(100_000), 1024)
    argv = [sys.executable, "-m", "colossalai.cli", *TRAIN, "--steps", "4", "--resume", str(ckpt)]
    proc = subprocess.run([*argv, "--vocab-size", "512"], capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "--vocab-size 512 does not match the checkpoint's tokenizer (bpe, 1024 ids)" in proc.stdout + proc.stderr


def test_resume_under_fsdp_on_two_processes(first_run):
    root, out = first_run
    ckpt = str(root / "ckpt" / "step-00000003")
    resumed = _cli(*TRAIN, "--steps", "6", "--plugin", "fsdp", "--nproc", "2", "--resume", ckpt)
    got, ref = _losses(resumed), _losses(out)
    assert sorted(got) == [4, 5, 6]
    # Another world size changes only the reduction order: printed losses agree to ~1e-5.
    assert all(abs(got[s] - ref[s]) < 1e-4 * ref[s] for s in got), (got, ref)
    assert "fsdp x 2 process(es)" in resumed


def test_train_with_sequence_parallel_on_two_processes(tmp_path):
    # all-to-all sequence parallelism: the sample is generated through padded windows
    plugin = ["hybrid", "--sp-size", "2", "--sp-kind", "all_to_all"]
    out = _cli(*TRAIN, "--steps", "3", "--nproc", "2", "--plugin", *plugin, "--save-dir", str(tmp_path))
    assert sorted(_losses(out)) == [1, 2, 3] and "hybrid x 2 process(es)" in out
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"


@pytest.mark.parametrize(
    "flags, want",
    [
        ("--plugin zero --zero-stage 3 --offload", dict(stage=3, offload=True)),
        ("--plugin gemini --device-budget 8MiB --placement static", dict(budget=8 << 20, placement="static")),
        ("--plugin hybrid --tp-mode 2d --tp-size 4", dict(tp_size=4, tp_mode="2d", pp_size=1)),
        (
            "--plugin hybrid --pp-size 2 --microbatches 4 --pp-schedule interleaved --pp-virtual 2",
            dict(pp_size=2, num_microbatches=4, pp_schedule="interleaved", pp_virtual=2),
        ),
    ],
)
def test_train_options_reach_the_plugin(flags, want):
    # The flags each plugin takes, as the plugin sees them (in-process: the plugins' own training
    # runs are the booster tests' -- ZeRO-3, Gemini, 2D tensor parallelism on 2-8 ranks -- and this
    # file's ddp, fsdp, sequence, pipeline and expert-parallel runs through the launcher).
    from colossalai.cli.main import build_parser
    from colossalai.cli.train import _plugin

    plugin = _plugin(build_parser().parse_args(["train", "--preset", "tiny", *flags.split()]))
    assert type(plugin).__name__.lower().startswith(flags.split()[1]), type(plugin).__name__
    assert {k: getattr(plugin, k) for k in want} == want


def test_run_launches_a_script_through_a_hostfile(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, pathlib\npathlib.Path(f\"rank{os.environ['RANK']}of{os.environ['WORLD_SIZE']}\").touch()\n"
    )
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# one host\nlocalhost slots=2\n")
    _cli("run", "--hostfile", str(hostfile), "--master-port", "29731", str(script), cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0of2", "rank1of2"]


def test_torchrun_command_and_hostfile_parsing(tmp_path):
    from colossalai.cli.launcher import Host, parse_hostfile, torchrun_command

    cmd = torchrun_command(4, ["train.py", "--x"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone", "train.py", "--x"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=8  # comment\n\nnode2\n")
    assert parse_hostfile(hostfile) == [Host("node1", 8), Host("node2", None)]
    hostfile.write_text("node1 cpus=8\n")
    with pytest.raises(ValueError, match="slots"):
        parse_hostfile(hostfile)


def test_check_reports_environment_and_smoke_test(capsys):
    from colossalai.cli.main import main

    main(["check"])
    out = capsys.readouterr().out
    assert "colossal-comm" in out and "torch" in out and "backends: gloo=yes" in out
    assert "smoke test: passed" in out


def test_bad_options_fail_clearly(capsys):
    from colossalai.cli.main import main

    with pytest.raises(SystemExit):
        main(["train", "--plugin", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_train_with_pipeline_parallel_on_two_processes(first_run, tmp_path):
    """``--pp-size 2``: the same losses as the one-process run (reduction order only), a
    checkpoint and an export of the whole model gathered from both stages."""
    _, out1 = first_run
    pp = ["--plugin", "hybrid", "--pp-size", "2", "--microbatches", "4", "--pp-schedule", "zero_bubble"]
    out = _cli(
        *TRAIN, "--steps", "3", "--nproc", "2", *pp, "--save-dir", str(tmp_path), "--export", str(tmp_path / "hf")
    )
    got, ref = _losses(out), _losses(out1)
    assert sorted(got) == [1, 2, 3] and all(abs(got[s] - ref[s]) < 1e-4 * ref[s] for s in got), (got, ref)
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    assert {"wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "blocks.1.ln_1.weight", "ln_f.weight"} <= set(exported)


def test_gemini_summary_says_model_states_exceed_the_device_budget():
    # Default plugin (gemini) and default budget (0.65 x the model states) on a tiny config whose
    # activations fit it: the summary says how much larger the states are, and what moved per tier.
    # Byte vocabulary: the tiny GPT's logits over 1024 BPE ids are too large for 0.65 x its states.
    tiny = ["train", "--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--corpus-bytes", "100000"]
    tiny += ["--vocab-size", "256"]
    out = _cli(*tiny, "--steps", "3", "--warmup", "1", "--progress", "plain", "--sample-tokens", "8")
    m = re.search(r"model states ([0-9.]+ \w+) = ([0-9.]+) x the device budget \(([0-9.]+ \w+) on cpu", out)
    assert m is not None, out
    assert float(m[2]) > 1 and "gemini x 1 process(es)" in out
    for tier in ("host -> device", "device -> host"):
        moved = re.search(rf"{tier}\s+│ ([0-9.]+) (\w+) \(([0-9.]+) (\w+)/step\)", out)
        assert moved is not None and float(moved[3]) > 0, out  # chunks move every step
    assert "offline optimum" in out and "time copying" in out


def test_train_moe_gpt_with_expert_parallel_on_two_processes():
    """``--model moe-gpt --ep-size 2``: each step's line shows the MoE drop rate and expert balance."""
    ep = ["--model", "moe-gpt", "--preset", "moe-tiny", "--plugin", "hybrid", "--ep-size", "2", "--nproc", "2"]
    out = _cli(*[a for a in TRAIN if a not in ("--preset", "tiny")], "--steps", "2", *ep)
    assert sorted(_losses(out)) == [1, 2] and "MoE GPT moe-tiny" in out, out
    lines = re.findall(r"step \d+/2 .* drop (\d+\.\d)% balance (\d+\.\d\d)", out)
    assert len(lines) == 2 and all(0 <= float(d) <= 100 and float(b) >= 1.0 for d, b in lines), out
