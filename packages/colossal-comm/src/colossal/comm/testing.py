"""Run a function on N local processes: the multi-process test harness (and demo launcher).

* Rendezvous through a fresh ``FileStore`` file, so parallel runs never race for a port.
* A deadline for the whole run: at the deadline every live rank dumps the stacks of all its
  threads (``faulthandler`` on ``SIGUSR1``), then every rank is killed and :class:`RankTimeout`
  shows those stacks. A hung collective can never hang CI.
* A rank that raises fails the run at once: the other ranks (usually blocked in a collective
  waiting for it) are killed and the *original* exception is re-raised in the caller, chained to
  the remote traceback, so ``pytest.raises(ValueError)`` works across processes.
* Each rank's return value comes back (pickled), indexed by rank.

Processes start through a ``forkserver`` that has already imported torch, so a rank starts in
milliseconds instead of re-importing torch each time (``start_method="spawn"`` is available).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import functools
import importlib
import multiprocessing as mp
import os
import pathlib
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_distributed", "distributed_test", "preload", "RankFailure", "RankTimeout", "RemoteTraceback"]

# Imported once by the forkserver so that ranks start without importing them. Building any torch
# optimizer imports torch._dynamo, which alone takes seconds per process on a busy machine.
_PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "colossal.comm"]


_SURVIVOR_GRACE_S = 5.0
"""After a rank dies, how long the harness waits for the survivors to raise before it kills them."""
STARTUP_TIMEOUT_S = 120.0
"""Seconds the ranks of a run may take to start (spawn, import torch) before :class:`RankTimeout`."""


def preload(*modules: str) -> None:
    """Have the rank forkserver import ``modules`` once, before it forks any rank.

    Call before the first :func:`run_distributed` of the process (e.g. at test-module import);
    later calls cannot change an already running forkserver and raise ``RuntimeError``.
    """
    if _context.cache_info().currsize:
        missing = [m for m in modules if m not in _PRELOAD]
        if missing:
            raise RuntimeError(f"the rank forkserver is already running; preload {missing} before the first run")
        return
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


class RemoteTraceback(Exception):
    """Carries a rank's traceback text; set as ``__cause__`` of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


class RankFailure(RuntimeError):
    """A rank failed with an exception that could not be re-raised as itself, or died."""


class RankTimeout(TimeoutError):
    """The run passed its deadline; the message holds every live rank's stacks."""


@dataclasses.dataclass(frozen=True)
class _FnRef:
    """A picklable reference to a module-level function, possibly wrapped by a decorator."""

    module: str
    qualname: str

    def resolve(self) -> Callable:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        while getattr(obj, "_colossal_distributed_test", False):
            obj = obj.__wrapped__
        return obj


def _worker(rank, world_size, store_path, fn, args, kwargs, results, stack_path, backend, threads, pg_timeout):
    import torch
    import torch.distributed as dist

    with open(stack_path, "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        results.put((rank, "started", None))  # the deadline counts from here ([Note: the deadline])
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
        )
        torch.set_num_threads(threads)
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(
                backend,
                init_method=f"file://{store_path}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
            target = fn.resolve() if isinstance(fn, _FnRef) else fn
            value = pickle.dumps(target(*args, **kwargs))
            # No rank may tear its connections down while a peer still talks to it (a late
            # sub-group handshake would see "connection closed by peer"): meet once more.
            dist.barrier()
            results.put((rank, "ok", value))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            text = traceback.format_exc()
            try:
                payload = pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
                payload = None
            results.put((rank, "error", (payload, f"{type(exc).__name__}: {exc}", text)))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            results.close()
            results.join_thread()


@functools.cache
def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _dump_stacks(procs: list, stack_paths: list[pathlib.Path], started: set[int]) -> str:
    for r, p in enumerate(procs):
        if p.is_alive() and r in started:  # a rank still starting up has no SIGUSR1 handler yet
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)

    def stacks(r: int, path: pathlib.Path) -> str:
        if r not in started:
            return "(rank had not started: still importing or spawning)"
        return path.read_text() or "(rank had exited)"

    return "".join(f"\n--- stacks of rank {r} ---\n{stacks(r, path)}" for r, path in enumerate(stack_paths))


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    threads: int = 1,
    start_method: str = "forkserver",
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes with torch.distributed
    initialised (ranks ``0..world_size-1``); return the list of their return values by rank.

    ``fn`` must be importable by name from a child process (a module-level function).
    ``timeout`` (seconds) bounds the run, with at least ``timeout / 2`` left once every rank has
    started (spawned and imported torch; starting up is bounded by :data:`STARTUP_TIMEOUT_S`); ``pg_timeout``
    (seconds, default ``timeout``) is the process group's own timeout (how long a collective waits
    for a peer that does not join); ``threads`` is each rank's torch thread count.

    A rank that dies (exits without reporting) fails the run with :class:`RankFailure` naming it
    and its exit code, followed by what the surviving ranks raised in the next seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    if pg_timeout <= 0:
        raise ValueError(f"pg_timeout must be positive, got {pg_timeout}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = _context(start_method)
    with tempfile.TemporaryDirectory(prefix="colossal-dist-") as tmp:
        store, stack_paths = os.path.join(tmp, "store"), [pathlib.Path(tmp, f"stack{r}") for r in range(world_size)]
        results, stacks = ctx.Queue(), [str(path) for path in stack_paths]
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store, fn, args, kwargs, results, stacks[r], backend, threads, pg_timeout),
                name=f"colossal-rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout, stack_paths)
        finally:
            _kill_all(procs)


def _collect(procs, results, world_size, timeout, stack_paths) -> list[Any]:
    # [Note: the deadline]
    # ``timeout`` bounds the run from its launch, as before, but a loaded machine that takes long
    # to spawn ranks (import torch, arm the stack dump) must not eat the whole budget of the
    # function under test: once every rank has started, the run gets at least ``timeout / 2`` more
    # (still before the process group's own ``pg_timeout``, which starts at the same moment, so a
    # hung rank is reported with every rank's stacks rather than as a gloo timeout). Starting up
    # has its own bound, STARTUP_TIMEOUT_S past the launch: a rank stuck importing cannot hang it.
    values: dict[int, Any] = {}
    started: set[int] = set()
    launch = time.monotonic()
    deadline = launch + max(timeout, STARTUP_TIMEOUT_S)
    while len(values) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.05)
        except queue.Empty:
            if time.monotonic() > deadline:
                stacks = _dump_stacks(procs, stack_paths, started)
                waited = "to start" if len(started) < world_size else "to finish"
                raise RankTimeout(
                    f"ranks {sorted(set(range(world_size)) - set(values))} of {world_size} did not finish "
                    f"within {timeout:.0f} s (waiting {waited}); every rank's stacks:{stacks}"
                ) from None
            if _dead(procs, values, []):  # let the survivors report what they raised, then fail
                _raise_if_dead(procs, values, _more_failures(results, grace=_SURVIVOR_GRACE_S, procs=procs))
            continue
        if status == "started":
            started.add(rank)
            if len(started) == world_size:  # every rank is up ([Note: the deadline])
                deadline = max(launch + timeout, time.monotonic() + timeout / 2)
            continue
        if status == "ok":
            values[rank] = pickle.loads(payload)
            continue
        failures = [(rank, payload), *_more_failures(results, grace=0.5)]
        _raise_if_dead(procs, values, failures)
        _raise_failure(failures)
    return [values[r] for r in range(world_size)]


def _dead(procs, values: dict, failures: list) -> list[tuple[int, int]]:
    """``(rank, exit code)`` of the ranks that exited non-zero without reporting."""
    reported = set(values) | {r for r, _ in failures}
    return [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]


def _raise_if_dead(procs, values: dict, failures: list) -> None:
    """A rank that exited non-zero without reporting is the root cause of whatever followed."""
    dead = _dead(procs, values, failures)
    if dead:
        others = "".join(f"\n--- rank {r} then failed: {payload[1]}" for r, payload in failures)
        raise RankFailure(f"rank {dead[0][0]} died with exit code {dead[0][1]} before reporting{others}")


def _more_failures(results, grace: float, procs: list | None = None) -> list[tuple[int, tuple]]:
    """Further ranks that fail within ``grace`` seconds (e.g. every rank raising); with ``procs``,
    stop early once every rank still alive has reported a failure."""
    found, end = [], time.monotonic() + grace
    while (left := end - time.monotonic()) > 0:
        if procs is not None and {r for r, p in enumerate(procs) if p.exitcode is None} <= {r for r, _ in found}:
            break
        try:
            rank, status, payload = results.get(timeout=min(left, 0.05))
        except queue.Empty:
            continue
        if status == "error":
            found.append((rank, payload))
    return found


def _raise_failure(failures: list[tuple[int, tuple]]) -> None:
    """Re-raise the root-cause exception: peers of a failed rank usually fail with gloo's
    "connection closed/reset by peer", so a rank without such a message is preferred."""
    secondary = ("by peer", "Connection closed", "Connection reset")
    failures = sorted(failures, key=lambda f: any(m in f[1][1] for m in secondary))
    rank, (payload, summary, text) = failures[0]
    others = "".join(f"\n--- rank {r} also failed: {p[1]}" for r, p in failures[1:])
    cause = RemoteTraceback(f"\n--- traceback of rank {rank} ---\n{text}{others}")
    exc: BaseException | None = None
    if payload is not None:
        try:
            exc = pickle.loads(payload)
        except Exception:  # noqa: BLE001 - fall back to a RankFailure carrying the text
            exc = None
    if not isinstance(exc, Exception):
        exc = RankFailure(f"rank {rank} failed: {summary}")
    raise exc from cause


def distributed_test(
    world_size: int = 2, timeout: float = 60.0, backend: str = "gloo", threads: int = 1
) -> Callable[[Callable], Callable]:
    """Decorator: the test body runs on ``world_size`` ranks (pytest parameters are forwarded).

    ::

        @distributed_test(world_size=4)
        def test_all_reduce():
            t = torch.ones(3) * dist.get_rank()
            ...
    """

    def decorate(fn: Callable) -> Callable:
        ref = _FnRef(fn.__module__, fn.__qualname__)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(ref, world_size, *args, timeout=timeout, backend=backend, threads=threads, **kwargs)

        wrapper._colossal_distributed_test = True  # type: ignore[attr-defined]
        return wrapper

    return decorate
