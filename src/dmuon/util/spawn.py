"""Run a function on N local gloo ranks and collect what each returns.

Used by ``dmuon bench``, ``examples/train_lm.py`` and dmuon's own tests; handy for users' tests too.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a server process that has imported torch and dmuon once (the first call
# starts it), instead of each starting a fresh interpreter that imports them again: a 4-rank start
# then takes a fraction of a second instead of seconds of CPU per rank. The server imports but
# runs nothing (no threads, no process group), so forking it is safe; each rank gets the caller's
# sys.path and working directory (multiprocessing's preparation data) and its environment (below).
def _start_method() -> str:
    """``"forkserver"`` where the platform has it, its preload set here (at the first start, not at
    import: importing dmuon leaves a program's own multiprocessing settings alone); else ``"spawn"``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "dmuon"])
    return "forkserver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_gloo_group(rank: int, world_size: int, port: int, timeout_s: float, threads: int,
                     environ: dict[str, str]) -> None:
    # A forked rank has the server's environment, from when it started: take the caller's as a
    # spawned one would.
    os.environ.clear()
    os.environ.update(environ)
    # A native crash (SIGSEGV, SIGABRT) of a rank then prints every thread's Python stack to
    # stderr, instead of the bare "terminated with signal" the parent reports.
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
            timeout_s: float, threads: int, environ: dict[str, str]) -> None:
    _join_gloo_group(rank, world_size, port, timeout_s, threads, environ)
    try:
        result = fn(rank, world_size, *args)
        # No rank tears its connections down while another still talks to it.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    with open(_result_path(out_dir, rank), "wb") as f:
        pickle.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # Every collective of every rank is done (the barrier), and the result is on
    # disk: leave without tearing down process groups and C++ threads, whose
    # destructors can abort a finished process ("terminate called without an
    # active exception", seen once in a fresh-venv run) and fail a passed test.
    os._exit(0)


NATIVE_CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL")
"""The signals :func:`run_distributed` counts as a native crash of a rank (not a Python exception)."""

CRASH_RETRIES_ENV = "DMUON_SPAWN_CRASH_RETRIES"
"""The environment variable giving :func:`run_distributed`'s ``crash_retries`` when it is None."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout_s: float = 120.0, threads: int = 1, crash_retries: int | None = None) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of processes.
        *args: Extra picklable arguments. Tensors among them arrive as one
            shared-memory storage for every rank: clone them before anything
            (an optimizer's state, say) updates them in place.
        timeout_s: Process-group timeout, so a mismatched collective fails
            instead of hanging.
        threads: ``torch.set_num_threads`` in each rank.
        crash_retries: How many times to run ``fn`` again, on fresh ranks, after a
            rank died of a native crash (one of :data:`NATIVE_CRASH_SIGNALS`, with
            every thread's Python stack on stderr), each time with a
            ``RuntimeWarning`` naming the rank and signal. A Python exception is
            never retried. None: the ``DMUON_SPAWN_CRASH_RETRIES`` environment
            variable, else 0. dmuon's own suite sets 1 (the repository's conftest.py): ranks
            of torch's gloo backend have died of SIGSEGV about once in a few full
            runs of it, each time in a test that passes on its own, so a crash
            seen twice in a row still fails the test, and wrong values always do.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        torch.multiprocessing.ProcessRaisedException: If any rank raised; the
            other ranks are terminated.
        torch.multiprocessing.ProcessExitedException: If a rank died, and no
            retry was left.
    """
    if crash_retries is None:
        crash_retries = int(os.environ.get(CRASH_RETRIES_ENV, "0"))
    for _ in range(crash_retries):
        try:
            return _run_once(fn, world_size, args, timeout_s, threads)
        except mp.ProcessExitedException as exc:
            if exc.signal_name not in NATIVE_CRASH_SIGNALS:
                raise
            warnings.warn(f"run_distributed({getattr(fn, '__name__', fn)!r}, {world_size}): rank "
                          f"{exc.error_index} died of {exc.signal_name} (its threads' stacks are on "
                          f"stderr); running it again on fresh ranks", RuntimeWarning, stacklevel=2)
    return _run_once(fn, world_size, args, timeout_s, threads)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
              threads: int) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, timeout_s, threads,
                                          dict(os.environ)),
                           nprocs=world_size, join=True, start_method=_start_method())
        results = []
        for rank in range(world_size):
            with open(_result_path(out_dir, rank), "rb") as f:
                results.append(pickle.load(f))
    return results


def _crashable_worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
                      timeout_s: float, threads: int, environ: dict[str, str]) -> None:
    _join_gloo_group(rank, world_size, port, timeout_s, threads, environ)
    code = 0
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - report it, then die as a crashed rank does
        result, code = {"raised": f"{type(exc).__name__}: {exc}"}, 1
    with open(_result_path(out_dir, rank), "wb") as f:
        pickle.dump(result, f)
    # No teardown: a crashed process does not say goodbye, and a group whose peer is
    # gone may block in destroy_process_group.
    os._exit(code)


def run_with_crashes(fn: Callable[..., Any], world_size: int, *args: Any,
                     timeout_s: float = 20.0, deadline_s: float = 120.0, threads: int = 1) -> list[Any]:
    """Like :func:`run_distributed`, but a rank that raises just dies, as a crash would.

    The other ranks are left to find out through the process group (a closed
    connection, or the ``timeout_s`` collective timeout), which is what a test of
    "no hang" needs to observe.

    Returns:
        Per rank: what ``fn`` returned, ``{"raised": "Type: message"}`` if it raised,
        or ``{"hung": True}`` for a rank still running after ``deadline_s`` (killed).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _crashable_worker, args=(world_size, free_port(), fn, args, out_dir, timeout_s, threads,
                                     dict(os.environ)),
            nprocs=world_size, join=False, start_method=_start_method(),
        )
        end = time.monotonic() + deadline_s
        for proc in ctx.processes:
            proc.join(max(0.0, end - time.monotonic()))
        results = []
        for rank, proc in enumerate(ctx.processes):
            if proc.is_alive():
                proc.kill()
                proc.join()
                results.append({"hung": True})
                continue
            path = _result_path(out_dir, rank)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append({"raised": f"exit code {proc.exitcode} before reporting"})
    return results
