"""The ``colossalai`` command: ``train``, ``finetune``, ``run``, ``plan``, ``check``."""

from __future__ import annotations

import argparse
import os
import sys

from colossalai.cli import launcher
from colossalai.cli.flag_hints import unknown_flag_hints
from colossalai.cli.rank_errors import ERRORS_ENV, run_recording
from colossalai.cli.train_args import DEBUG_HELP, add_train_arguments

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit code 2, as argparse); an unknown flag of a
    sub-command is reported by that sub-command, with a hint (:mod:`colossalai.cli.flag_hints`)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's ``parse_args``; unknown flags are an error of their sub-command, with hints."""
        namespace, extras = self.parse_known_args(args, namespace)
        if not extras:
            return namespace
        sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        command = getattr(namespace, "command", None)
        parser = sub.choices[command] if sub is not None and command in sub.choices else self
        hints = unknown_flag_hints(parser, command or "", extras)
        parser.error("; ".join([f"unrecognized arguments: {' '.join(extras)}", *hints]))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = _Parser(prog="colossalai", description="Colossal: train, launch, check.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train", help="train a GPT, PaLM or MoE GPT on the embedded corpus"))
    from colossalai.cli.finetune import add_finetune_arguments

    add_finetune_arguments(
        sub.add_parser("finetune", help="LoRA fine-tuning of a model that train wrote, on a corpus of your choosing")
    )
    run = sub.add_parser("run", help="launch a script on N processes of one or several hosts (torchrun)")
    run.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=1, help="processes per host")
    run.add_argument("--hostfile", default=None, help="file of 'host [slots=N]' lines")
    run.add_argument("--master-port", type=int, default=29500, help="rendezvous port (several hosts)")
    run.add_argument(
        "--max-restarts", type=int, default=0, help="restart every worker up to N times after a failure (torchrun)"
    )
    run.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    run.add_argument("-m", dest="module", action="store_true", help="target is a module, as in python -m")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script (or module) and its arguments")
    from colossalai.cli.plan import add_plan_arguments

    add_plan_arguments(
        sub.add_parser("plan", help="which layouts fit a model on some hardware, and how fast (nothing allocated)")
    )
    sub.add_parser("check", help="report installed components, devices, backends; 2-process smoke test")
    return parser


def _validate(args: argparse.Namespace, quiet: bool) -> bool:
    """Check ``args`` before anything starts: prints one line per problem; False when unusable."""
    from colossalai.cli import validate

    try:
        if args.command == "run":
            warnings = validate.validate_run(args)
        elif args.command == "finetune":
            world = int(os.environ.get("WORLD_SIZE", args.nproc)) if launcher.under_launcher() else None
            warnings = validate.validate_finetune(args, world)
        else:
            world = int(os.environ.get("WORLD_SIZE", args.nproc)) if launcher.under_launcher() else None
            warnings = validate.validate_train(args, world)
    except validate.UsageError as exc:
        print(f"colossalai {args.command}: error: {exc}", file=sys.stderr)
        return False
    for warning in [] if quiet else warnings:
        print(f"colossalai {args.command}: warning: {warning}", file=sys.stderr)
    return True


def _train_worker(args: argparse.Namespace) -> int:
    """``train`` in this process; under our own relaunch a failure is recorded for the parent to
    print once, and the rank leaves at once (``[Note: reporting rank failures once]``). Alone, a
    user's error is one line and exit code 2 (``[Note: one line for a setup error]``)."""
    from colossalai.cli.train import train
    from colossalai.cli.user_errors import cli_message

    if ERRORS_ENV in os.environ:
        run_recording(lambda: train(args), lambda exc: cli_message(exc, args))
        return 0
    try:
        train(args)
    except Exception as exc:  # noqa: BLE001 - a user's error is one line, any other keeps its traceback
        message = None if args.debug else cli_message(exc, args)
        if message is None:
            raise
        print(f"colossalai {args.command}: error: {message}", file=sys.stderr)
        _leave_process_group()
        return 2
    return 0


def _leave_process_group() -> None:
    """Destroy the process group ``train`` started (torch warns at exit about one left up)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``colossalai`` console script (exit code 2: a bad argument)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "check":
        from colossalai.cli.check import check

        return check()
    if args.command == "plan":
        from colossalai.cli.plan import plan_command
        from colossalai.cli.validate import UsageError

        try:
            return plan_command(args)
        except (UsageError, ValueError, FileNotFoundError) as exc:
            print(f"colossalai plan: error: {exc}", file=sys.stderr)
            return 2
    if not _validate(args, quiet=ERRORS_ENV in os.environ):
        return 2
    if args.command == "run":
        return launcher.run_script(
            args.target,
            nproc=args.nproc,
            hostfile=args.hostfile,
            port=args.master_port,
            module=args.module,
            max_restarts=args.max_restarts,
            debug=args.debug,
        )
    if args.nproc > 1 and not launcher.under_launcher():
        return launcher.relaunch_under_torchrun(args.nproc, argv, debug=args.debug)
    return _train_worker(args)


if __name__ == "__main__":
    sys.exit(main())
