"""``colossalai run`` and the self-relaunch of ``colossalai train --nproc N``: thin layers over
``torchrun`` (``python -m torch.distributed.run``).

One host: ``torchrun --standalone --nproc-per-node N``. Several hosts (``--hostfile``, one host
per line, optional ``slots=N``; ``#`` comments): the first host is the rendezvous master; this
host's part runs locally, the others through ``ssh HOST 'cd CWD && torchrun ... --node-rank i'``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile

from colossalai.cli.rank_errors import ERRORS_ENV, first_failure, report_failure, split_launcher_noise

__all__ = ["Host", "parse_hostfile", "torchrun_command", "run_script", "relaunch_under_torchrun"]

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """One line of a hostfile."""

    name: str
    """Host name or address."""
    slots: int | None = None
    """Processes to start there (None: ``--nproc-per-node``)."""


def parse_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read ``host [slots=N]`` lines (blank lines and ``#`` comments ignored)."""
    hosts = []
    for lineno, raw in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = None
        for item in rest:
            key, _, value = item.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise ValueError(f"{path}:{lineno}: expected 'host [slots=N]' with N >= 1, got {raw!r}")
            slots = int(value)
        hosts.append(Host(name, slots))
    if not hosts:
        raise ValueError(f"hostfile {path} names no host")
    return hosts


def torchrun_command(nproc: int, target: list[str], *, nnodes: int = 1, node_rank: int = 0, master: str | None = None,
                     port: int = 29500, module: bool = False, max_restarts: int = 0) -> list[str]:  # fmt: skip
    """The ``python -m torch.distributed.run`` command line for one node (``max_restarts``:
    torchrun's ``--max-restarts``, how often the whole worker group is restarted after a failure)."""
    if nproc < 1:
        raise ValueError(f"nproc per node must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    if nnodes == 1 and master is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        cmd += ["--master-addr", master or "127.0.0.1", "--master-port", str(port)]
    return cmd + (["-m"] if module else []) + target


def _is_local(host: str) -> bool:
    return host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def _worker_target(target: list[str], module: bool) -> list[str]:
    """``target`` wrapped in :mod:`colossalai.cli.run_worker` (a module target for torchrun)."""
    return ["colossalai.cli.run_worker", *(["-m"] if module else []), *target]


def run_script(target: list[str], *, nproc: int, hostfile: str | None = None, port: int = 29500,
               module: bool = False, max_restarts: int = 0, debug: bool = False) -> int:  # fmt: skip
    """Launch ``target`` (a script and its arguments) on every host; returns the worst exit code.

    On one host a failure is reported once: the first failing rank's ``Type: message`` (with
    ``debug``, its traceback and the kept folder of every rank's) ([Note: reporting rank failures
    once] in :mod:`colossalai.cli.rank_errors`). With ``--hostfile`` each host's output passes
    through as torchrun prints it."""
    if not target:
        raise ValueError("colossalai run needs a script to run (e.g. colossalai run --nproc 2 train.py)")
    if hostfile is None:
        wrapped = _worker_target(target, module)
        cmd = torchrun_command(nproc, wrapped, module=True, max_restarts=max_restarts)
        return _run_reporting_once(cmd, nproc, command="run", debug=debug)
    hosts = parse_hostfile(hostfile)
    master = hosts[0].name
    procs = []
    for i, host in enumerate(hosts):
        cmd = torchrun_command(host.slots or nproc, target, nnodes=len(hosts), node_rank=i, master=master,
                               port=port, module=module, max_restarts=max_restarts)  # fmt: skip
        if not _is_local(host.name):
            remote = f"cd {shlex.quote(os.getcwd())} && {shlex.join(cmd)}"
            cmd = ["ssh", "-o", "BatchMode=yes", host.name, remote]
        procs.append(subprocess.Popen(cmd))
    return max(p.wait() for p in procs)


def _run_reporting_once(cmd: list[str], nproc: int, *, command: str, debug: bool = False) -> int:
    """Run a torchrun command whose workers record their failures; print the first failing rank's
    message once (or, when none recorded one, torchrun's own report). The folder of the records is
    removed at the end, unless ``debug`` and a rank failed. Returns the exit code."""
    errors = tempfile.mkdtemp(prefix="colossalai-errors-")
    env = {**os.environ, ERRORS_ENV: errors}
    env.setdefault("OMP_NUM_THREADS", "1")
    keep = False
    try:
        with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
            held = split_launcher_noise(proc.stderr)
        first, failed = first_failure(errors)
        if proc.returncode == 0 or first is None:
            sys.stderr.writelines(held)
            return proc.returncode
        keep = debug
        return report_failure(first, failed, nproc, command=command, debug=debug)
    finally:
        if not keep:
            shutil.rmtree(errors, ignore_errors=True)


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` minus ``--nproc N`` / ``--nproc=N`` (workers must not relaunch, and torchrun's own
    parser would find ``--nproc`` an ambiguous prefix of its options)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch_under_torchrun(nproc: int, argv: list[str], debug: bool = False) -> int:
    """Start ``colossalai <argv>`` again as ``nproc`` torchrun workers of this host; a failure is
    reported once, as the first failing rank's message (``[Note: reporting rank failures once]``
    in :mod:`colossalai.cli.rank_errors`). Returns the exit code (2: a user's error)."""
    cmd = torchrun_command(nproc, ["colossalai.cli", *_without_nproc(argv)], module=True)
    return _run_reporting_once(cmd, nproc, command=argv[0] if argv else "train", debug=debug)


def under_launcher() -> bool:
    """True inside a torchrun (or similar) worker."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
