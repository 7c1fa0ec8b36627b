"""Launching ranks for the tests: :func:`dmuon.testing.spawn.run_distributed` plus what only a test suite wants.

* :func:`run_distributed`: a rank that dies of a native crash (SIGSEGV, SIGABRT, ... in torch's gloo
  ranks; seen about once in a few full runs, each time in a test that passes on its own) runs the
  function again once on fresh ranks. Every crash is recorded in :data:`CRASHES` with the test id and
  the crashed rank's faulthandler stacks, and the root conftest.py prints them in pytest's summary, so
  a retry never goes unseen. A crash on the retry too fails the test, with both crashes' stacks; a
  Python exception or a wrong value fails at once.
* :func:`run_with_crashes`: a rank that raises just dies, as a crash would, for tests of "the others
  fail, not hang".
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

from dmuon.bench.models.qwen2 import TRANSFORMERS_MODULE
from dmuon.testing import spawn
from dmuon.testing.spawn import _join_gloo_group, _result_path, _start_method, free_port

# The suite's rank server is started by whichever test launches first; the bench's tests launch ranks that
# build transformers' Qwen2 model, so the server imports it once for all of them.
spawn.preload(TRANSFORMERS_MODULE)

NATIVE_CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL")
"""The signals :func:`run_distributed` counts as a native crash of a rank (not a Python exception)."""

CRASH_RETRIES = 1
"""Runs after a native crash; a crash on each of them fails the test."""


@dataclass
class Crash:
    """One native crash of a rank, as the summary reports it."""

    test: str
    """pytest's id of the test that launched the ranks (its fixture's, for a shared run)."""
    launch: str
    """The function the ranks ran and their number."""
    rank: int
    signal: str
    stacks: str
    """The crashed rank's faulthandler output: every thread's Python stack at the signal."""
    retried: bool
    """True: the function ran again; False: no retry was left and the test failed."""


CRASHES: list[Crash] = []
"""Every crash :func:`run_distributed` saw in this pytest process; conftest.py puts each on the report of the
test phase that saw it, and its summary hook prints them from the reports."""

_stacks_file = None
"""The rank's faulthandler file, kept open for the rank's lifetime (faulthandler writes to its fd)."""


def _with_stacks(rank: int, world_size: int, fn: Callable, stacks_dir: str, *args: Any) -> Any:
    """``fn`` with faulthandler writing to a file the launcher reads after a crash (stderr is pytest's
    capture, shown only for a failed test, so a retried crash would leave no trace)."""
    global _stacks_file
    _stacks_file = open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w")
    faulthandler.enable(_stacks_file, all_threads=True)
    return fn(rank, world_size, *args)


def _current_test() -> str:
    # pytest sets it to "<node id> (<phase>)" for the running test, fixtures included.
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test running)").rsplit(" ", 1)[0]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                    threads: int = 1, crash_retries: int = CRASH_RETRIES,
                    crashes: list[Crash] | None = None) -> list[Any]:
    """:func:`dmuon.testing.spawn.run_distributed`, run again after a native crash of a rank.

    Args:
        crash_retries: Runs after a crash before the crash fails the call.
        crashes: Where each crash is recorded (default :data:`CRASHES`, the pytest summary's).

    Raises:
        torch.multiprocessing.ProcessExitedException: A rank crashed on every run, or died of another
            signal or exit code; its message carries the crashed ranks' stacks.
        torch.multiprocessing.ProcessRaisedException: A rank raised (never run again).
    """
    record = CRASHES if crashes is None else crashes
    launch = f"{getattr(fn, '__name__', fn)} on {world_size} ranks"
    seen = []
    for attempt in range(crash_retries + 1):
        with tempfile.TemporaryDirectory() as stacks_dir:
            try:
                return spawn.run_distributed(_with_stacks, world_size, fn, stacks_dir, *args,
                                             timeout_s=timeout_s, threads=threads)
            except mp.ProcessExitedException as exc:
                if exc.signal_name not in NATIVE_CRASH_SIGNALS:
                    raise
                path = os.path.join(stacks_dir, f"rank{exc.error_index}.txt")
                stacks = open(path).read().strip() if os.path.exists(path) else ""
                crash = Crash(_current_test(), launch, exc.error_index, exc.signal_name,
                              stacks or "(no stacks: the rank died before or outside the function)",
                              retried=attempt < crash_retries)
                record.append(crash)
                seen.append(crash)
                if not crash.retried:
                    text = "\n".join(f"--- run {k + 1}: rank {c.rank} died of {c.signal}\n{c.stacks}"
                                     for k, c in enumerate(seen))
                    raise mp.ProcessExitedException(
                        f"{launch}: a rank died of a native crash on each of {len(seen)} runs\n{text}",
                        exc.error_index, exc.error_pid, exc.exit_code, exc.signal_name) from exc
    raise AssertionError("unreachable: the last run returns or raises")


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
