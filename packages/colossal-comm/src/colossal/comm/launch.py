"""Initialise torch.distributed from the environment a launcher left behind.

Understood launchers, in order of precedence:

========== ======================================= ============================================
launcher   rank / world size / local rank          rendezvous address
========== ======================================= ============================================
torchrun   ``RANK`` ``WORLD_SIZE`` ``LOCAL_RANK``  ``MASTER_ADDR`` ``MASTER_PORT``
SLURM      ``SLURM_PROCID`` ``SLURM_NTASKS``       ``MASTER_ADDR`` (or first host of
           ``SLURM_LOCALID``                       ``SLURM_JOB_NODELIST``), ``MASTER_PORT``
OpenMPI    ``OMPI_COMM_WORLD_RANK`` ``..._SIZE``   ``MASTER_ADDR`` ``MASTER_PORT``
           ``OMPI_COMM_WORLD_LOCAL_RANK``
none       a plain process: world size 1           an in-memory store
========== ======================================= ============================================
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LaunchInfo",
    "launch",
    "ensure_process_group",
    "detect_launcher",
    "default_device",
    "default_backend",
    "resolve_timeout",
]

_SCHEMES = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
}
DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchInfo:
    """Where this process sits, as read from the environment."""

    launcher: str
    """``"torchrun"``, ``"slurm"``, ``"openmpi"`` or ``"none"``."""
    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes of this host (selects the CUDA device)."""
    master_addr: str
    """Rendezvous host."""
    master_port: int
    """Rendezvous port."""


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device(local_rank: int | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def detect_launcher(env: dict[str, str] | None = None) -> LaunchInfo:
    """Read a :class:`LaunchInfo` from ``env`` (default ``os.environ``).

    Raises ``ValueError`` naming the missing variables when a launcher's variables are half set.
    """
    env = dict(os.environ if env is None else env)
    for name, keys in _SCHEMES.items():
        present = [k for k in keys[:2] if k in env]
        if not present:
            continue
        missing = [k for k in keys[:2] if k not in env]
        if missing:
            raise ValueError(f"{name} environment is half set: have {present}, missing {missing}")
        rank, world, local = (int(env.get(k, "0")) for k in keys)
        if not 0 <= rank < world:
            raise ValueError(f"{keys[0]}={rank} must lie in [0, {keys[1]}={world})")
        addr = env.get("MASTER_ADDR") or (
            _first_host(env["SLURM_JOB_NODELIST"]) if "SLURM_JOB_NODELIST" in env else None
        )
        if addr is None and world > 1:
            raise ValueError(f"{name} environment with world size {world} needs MASTER_ADDR")
        return LaunchInfo(name, rank, world, local, addr or "127.0.0.1", int(env.get("MASTER_PORT", DEFAULT_PORT)))
    return LaunchInfo("none", 0, 1, 0, "127.0.0.1", DEFAULT_PORT)


DEFAULT_TIMEOUT_S = 1800.0
"""Process-group timeout of :func:`launch` unless ``timeout`` or ``COLOSSAL_COMM_TIMEOUT`` says
otherwise: how long a collective waits for a peer that is alive but does not join (a rank that
*dies* is noticed at once on gloo: its connections close)."""


def resolve_timeout(timeout: float | None = None, env: dict[str, str] | None = None) -> float:
    """``timeout`` if given, else ``COLOSSAL_COMM_TIMEOUT`` (seconds) from ``env``, else
    :data:`DEFAULT_TIMEOUT_S`; ``ValueError`` naming the source for a value that is not positive."""
    source = "timeout"
    if timeout is None:
        raw = (os.environ if env is None else env).get("COLOSSAL_COMM_TIMEOUT")
        if raw is None:
            return DEFAULT_TIMEOUT_S
        source = "COLOSSAL_COMM_TIMEOUT"
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"COLOSSAL_COMM_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not timeout > 0:
        raise ValueError(f"{source} must be positive seconds, got {timeout!r}")
    return float(timeout)


def launch(backend: str | None = None, timeout: float | None = None, env: dict[str, str] | None = None) -> LaunchInfo:
    """Initialise the default process group from the launcher's environment and set the device.

    ``timeout`` (seconds) bounds every collective of the process group: default
    ``COLOSSAL_COMM_TIMEOUT`` from the environment, else :data:`DEFAULT_TIMEOUT_S` (30 minutes,
    torch's own default). Idempotent: when torch.distributed is already initialised it only
    reports. A plain process (no launcher variables) becomes a world of size 1 on an in-memory store.
    """
    info = detect_launcher(env)
    timeout = resolve_timeout(timeout, env)
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available here; use 'gloo'")
    if dist.is_initialized():
        return info
    if backend == "nccl":
        torch.cuda.set_device(default_device(info.local_rank))
    kwargs = dict(
        backend=backend, rank=info.rank, world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout)
    )
    env = os.environ if env is None else env
    if info.world_size == 1 and info.launcher == "none":
        dist.init_process_group(store=dist.HashStore(), **kwargs)
    elif info.launcher == "torchrun" and "TORCHELASTIC_RESTART_COUNT" in env:
        dist.init_process_group(store=_torchelastic_store(info, timeout, env), **kwargs)
    else:
        dist.init_process_group(init_method=f"tcp://{info.master_addr}:{info.master_port}", **kwargs)
    return info


def ensure_process_group(who: str) -> None:
    """Make sure a default process group exists before ``who`` (an engine or a plugin) uses it.

    A plain single process (no launcher variables: ``python train.py``) gets a world of one, as
    :func:`launch` makes it, so every engine and plugin runs without ``launch()``; a process started
    by a launcher for several ranks must call ``launch()`` itself (``ValueError`` otherwise: guessing
    its rendezvous would hang the other ranks).
    """
    if dist.is_initialized():
        return
    info = detect_launcher()
    if info.world_size != 1:
        raise ValueError(
            f"{who} needs torch.distributed initialised: this process is rank {info.rank} of "
            f"{info.world_size} ({info.launcher}); call colossal.comm.launch() first"
        )
    launch()


# [Note: a fresh store namespace per torchrun attempt]
# torchrun (torch >= 2.4) shares one TCPStore, the agent's, between every attempt of a job started
# with --max-restarts. The keys the process group wrote in attempt 0 (each rank's gloo address,
# under "default_pg/0/") are still there in attempt 1, and a rank that reads a peer's key before
# that peer has rewritten it connects to the dead process' port and fails ("Gloo connectFullMesh
# failed ... Connection refused", or a hang); whether that happens depends on which rank starts
# first (colossalai's restart test failed this way every time before this fix, a bare script with
# fast start-up did not). Each attempt therefore works under its own prefix of the store.


def _torchelastic_store(info: LaunchInfo, timeout: float, env) -> dist.Store:
    """The rendezvous store of a torchrun worker, prefixed with the attempt (restart) number."""
    agent_hosts_it = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        info.master_addr,
        info.master_port,
        info.world_size,
        is_master=not agent_hosts_it and info.rank == 0,
        timeout=datetime.timedelta(seconds=timeout),
        multi_tenant=True,
    )
    return dist.PrefixStore(f"colossal/attempt{env['TORCHELASTIC_RESTART_COUNT']}", store)
