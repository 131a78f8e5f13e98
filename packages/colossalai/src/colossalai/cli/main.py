"""The ``colossalai`` command: ``train``, ``run``, ``check``."""

from __future__ import annotations

import argparse
import sys

from colossalai.cli.train_args import add_train_arguments

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="colossalai", description="Colossal: train, launch, check.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train", help="train a GPT on the embedded corpus (the main job)"))
    run = sub.add_parser("run", help="launch a script on N processes of one or several hosts (torchrun)")
    run.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=1, help="processes per host")
    run.add_argument("--hostfile", default=None, help="file of 'host [slots=N]' lines")
    run.add_argument("--master-port", type=int, default=29500, help="rendezvous port (several hosts)")
    run.add_argument("-m", dest="module", action="store_true", help="target is a module, as in python -m")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script (or module) and its arguments")
    sub.add_parser("check", help="report installed components, devices, backends; 2-process smoke test")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``colossalai`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "check":
        from colossalai.cli.check import check

        return check()
    from colossalai.cli import launcher

    if args.command == "run":
        return launcher.run_script(
            args.target, nproc=args.nproc, hostfile=args.hostfile, port=args.master_port, module=args.module
        )
    if args.nproc > 1 and not launcher.under_launcher():
        return launcher.relaunch_under_torchrun(args.nproc, argv)
    from colossalai.cli.train import train

    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
