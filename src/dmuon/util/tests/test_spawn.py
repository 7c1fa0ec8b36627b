"""run_distributed: results in rank order; a native crash of a rank retried as asked; an exception never."""

from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from dmuon.util.spawn import run_distributed


def _rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def _crash_once(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 dies of SIGSEGV the first time (the marker file does not exist yet), then returns."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def _raise(rank: int, world_size: int, attempts: str) -> int:
    """Every rank raises (so whichever the parent hears of first names the error) after counting the attempt."""
    if rank == 0:
        with open(attempts, "a") as f:
            f.write("attempt\n")
    raise ValueError("raised by a rank")


def test_results_come_in_rank_order():
    assert run_distributed(_rank_and_size, 3, crash_retries=0) == [(0, 3), (1, 3), (2, 3)]


def test_a_native_crash_runs_again_with_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"rank 1 died of SIGSEGV"):
        assert run_distributed(_crash_once, 2, str(tmp_path / "m"), crash_retries=1) == [0, 1]


def test_a_native_crash_without_retries_fails(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="SIGSEGV"):
        run_distributed(_crash_once, 2, str(tmp_path / "m"), crash_retries=0)


def test_an_exception_is_never_run_again(tmp_path):
    attempts = tmp_path / "attempts"
    with pytest.raises(mp.ProcessRaisedException, match="raised by a rank"):
        run_distributed(_raise, 2, str(attempts), crash_retries=3)
    assert attempts.read_text().count("attempt") == 1
