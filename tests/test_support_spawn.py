"""The tests' launcher (support.spawn): a native crash of a rank runs again once and is recorded with the
test id and the rank's stacks; a second crash fails; an exception is never run again."""

from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from support.spawn import run_distributed


def _crash(rank: int, world_size: int, marker: str, times: int) -> int:
    """Rank 1 dies of SIGSEGV on its first ``times`` runs (counted in the marker file), then returns."""
    if rank == 1:
        runs = open(marker).read().count("x") if os.path.exists(marker) else 0
        if runs < times:
            with open(marker, "a") as f:
                f.write("x")
            os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def _raise(rank: int, world_size: int, attempts: str) -> int:
    """Every rank raises (so whichever the parent hears of first names the error) after counting the attempt."""
    if rank == 0:
        with open(attempts, "a") as f:
            f.write("attempt\n")
    raise ValueError("raised by a rank")


def test_a_native_crash_runs_again_and_is_recorded(tmp_path, request):
    crashes = []
    assert run_distributed(_crash, 2, str(tmp_path / "m"), 1, crashes=crashes) == [0, 1]
    assert len(crashes) == 1
    crash = crashes[0]
    assert (crash.test, crash.rank, crash.signal, crash.retried) == (request.node.nodeid, 1, "SIGSEGV", True)
    assert crash.launch == "_crash on 2 ranks"
    # faulthandler's dump names the signal and the frame that raised it.
    assert "Segmentation fault" in crash.stacks and "in _crash" in crash.stacks, crash.stacks


def test_a_crash_on_the_retry_too_fails_with_both_stacks(tmp_path):
    crashes = []
    with pytest.raises(mp.ProcessExitedException, match="SIGSEGV") as info:
        run_distributed(_crash, 2, str(tmp_path / "m"), 2, crashes=crashes)
    assert [c.retried for c in crashes] == [True, False]
    message = str(info.value)
    assert "on each of 2 runs" in message and message.count("in _crash") == 2, message


def test_without_retries_a_crash_fails_at_once(tmp_path):
    crashes = []
    with pytest.raises(mp.ProcessExitedException, match="SIGSEGV"):
        run_distributed(_crash, 2, str(tmp_path / "m"), 1, crash_retries=0, crashes=crashes)
    assert [c.retried for c in crashes] == [False]


def test_an_exception_is_never_run_again(tmp_path):
    attempts = tmp_path / "attempts"
    crashes = []
    with pytest.raises(mp.ProcessRaisedException, match="raised by a rank"):
        run_distributed(_raise, 2, str(attempts), crash_retries=3, crashes=crashes)
    assert attempts.read_text().count("attempt") == 1 and crashes == []
