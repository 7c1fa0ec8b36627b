"""Run a function on N local gloo ranks and collect what each returns.

Used by ``dmuon bench``, ``examples/train_lm.py`` and dmuon's own tests (whose support adds a retry
after a native crash of a rank, ``tests/support/spawn.py``); handy for users' tests too. Each rank runs
under the stream checker where ``$DMUON_CHECK_STREAMS`` is 1 (:func:`dmuon.testing.install_checker_from_env`).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import random
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmuon.testing import install_checker_from_env

# Ranks are forked from a server process that has imported torch and dmuon once (the first call
# starts it), instead of each starting a fresh interpreter that imports them again: a 4-rank start
# then takes a fraction of a second instead of seconds of CPU per rank. The server imports but
# runs nothing (no process group, no work of its own), so forking it is safe; each rank gets the caller's
# sys.path and working directory (multiprocessing's preparation data) and its environment (below).
_RANK_PRELOAD = ["torch", "torch.distributed", "dmuon"]


def preload(*modules: str) -> None:
    """Has the rank server import ``modules`` too, once, before it forks ranks: for a module every rank
    imports whose import costs seconds of CPU (the bench's ranks build transformers' Qwen2 model). Call it
    before this process's first launch: a running server keeps what it imported. A module that does not
    import is skipped there (each rank then imports it itself, or fails as it would have)."""
    _RANK_PRELOAD.extend(m for m in modules if m not in _RANK_PRELOAD)


def _start_method() -> str:
    """``"forkserver"`` where the platform has it, its preload set here (at the first start, not at
    import: importing dmuon leaves a program's own multiprocessing settings alone); else ``"spawn"``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_RANK_PRELOAD))
    return "forkserver"


_EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range: the ports ``bind(0)`` and ``connect()`` hand out."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now, for a launch's store (``MASTER_PORT``).

    Chosen at random below the kernel's ephemeral range, where only an explicit choice binds: a port that
    ``bind(0)`` hands out is free again once that probe closes, and any socket's ``bind(0)`` or ``connect()``
    (another launch's gloo connections, when two test processes launch at once) may take it before rank 0's
    store binds it. Two explicit choices meet with odds of one in the range's size (16k ports). ``bind(0)``
    where no port below the range is free in 64 tries."""
    low, _ = _ephemeral_ports()
    first = max(1024, low - 16384)
    below = range(first, low)
    for port in random.SystemRandom().sample(below, min(64, len(below))):
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
    install_checker_from_env()


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")


def _raised_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.raised")


def _exit_raising(out_dir: str, rank: int) -> None:
    """Leaves a rank whose function raised at once, its traceback where :func:`run_distributed` reads it.

    Neither ``destroy_process_group`` nor an interpreter shutdown: both wait for this rank's
    collectives still in flight (the group's, a worker thread's), which the other ranks, waiting in
    a collective this rank left, never complete: the launch would hang for the group's whole
    timeout instead of failing now (the launcher ends the other ranks once this one exits)."""
    with open(_raised_path(out_dir, rank), "w") as f:
        f.write(traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
            timeout_s: float, threads: int, environ: dict[str, str]) -> None:
    _join_gloo_group(rank, world_size, port, timeout_s, threads, environ)
    try:
        result = fn(rank, world_size, *args)
        # No rank tears its connections down while another still talks to it.
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported through the file, then the rank leaves
        _exit_raising(out_dir, rank)
    with open(_result_path(out_dir, rank), "wb") as f:
        pickle.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # Every collective of every rank is done (the barrier), and the result is on
    # disk: leave without tearing down process groups and C++ threads, whose
    # destructors can abort a finished process ("terminate called without an
    # active exception", seen once in a fresh-venv run) and fail a passed test.
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout_s: float = 120.0, threads: int = 1) -> list[Any]:
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

    Returns:
        The per-rank return values, in rank order.

    Raises:
        torch.multiprocessing.ProcessRaisedException: If any rank raised; the
            other ranks are terminated at once (not left to time out in a
            collective the raising rank left).
        torch.multiprocessing.ProcessExitedException: If a rank died (a native
            crash prints every thread's Python stack to stderr first).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, timeout_s, threads,
                                              dict(os.environ)),
                               nprocs=world_size, join=True, start_method=_start_method())
        except mp.ProcessExitedException as exc:
            raised = _raised_path(out_dir, exc.error_index)
            if not os.path.exists(raised):
                raise
            with open(raised) as f:  # the rank's exception, as torch reports one that reaches its wrapper
                text = f"\n\n-- Process {exc.error_index:d} terminated with the following error:\n{f.read()}"
            raise mp.ProcessRaisedException(text, exc.error_index, exc.error_pid) from None
        results = []
        for rank in range(world_size):
            with open(_result_path(out_dir, rank), "rb") as f:
                results.append(pickle.load(f))
    return results
