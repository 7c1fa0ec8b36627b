"""run_distributed: results in rank order; a native crash or an exception of a rank fails the call (no retry).
free_port: a bindable port below the kernel's ephemeral range."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmuon.testing import spawn
from dmuon.testing.spawn import free_port, run_distributed


def _rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def _crash_once(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 dies of SIGSEGV the first time (the marker file does not exist yet), then returns."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def _raise(rank: int, world_size: int) -> int:
    raise ValueError("raised by a rank")


def test_results_come_in_rank_order():
    assert run_distributed(_rank_and_size, 3) == [(0, 3), (1, 3), (2, 3)]


def test_a_native_crash_fails_without_a_retry(tmp_path):
    # The shipped launcher never runs a function twice: the crash fails the call even though a second
    # run would pass (the marker now exists).
    with pytest.raises(mp.ProcessExitedException, match="SIGSEGV"):
        run_distributed(_crash_once, 2, str(tmp_path / "m"))
    assert (tmp_path / "m").exists()


def test_an_exception_fails_the_call():
    with pytest.raises(mp.ProcessRaisedException, match="raised by a rank"):
        run_distributed(_raise, 2)


def _raise_with_a_collective_in_flight(rank: int, world_size: int) -> int:
    """Rank 1 raises with an all-reduce in flight that a thread of its own waits for (a worker thread's
    collective), while rank 0 waits in a receive rank 1 never sends: neither completes before the
    group's timeout."""
    x = torch.ones(2)
    if rank == 1:
        work = dist.all_reduce(x, async_op=True)
        threading.Thread(target=work.wait, name="waits-in-a-collective").start()
        raise ValueError("raised with a collective in flight")
    dist.recv(x, src=1)
    return rank


def test_a_rank_that_raises_while_the_others_wait_in_a_collective_fails_the_call_at_once():
    # Tearing the group down or shutting the interpreter down in the raising rank waits for its collective
    # in flight until the group's timeout (300 s here); the launch must fail as soon as the rank raised.
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="raised with a collective in flight") as info:
        run_distributed(_raise_with_a_collective_in_flight, 2, timeout_s=300)
    elapsed = time.monotonic() - start
    assert "-- Process 1 terminated with the following error" in str(info.value)
    assert elapsed < 120, f"the launch took {elapsed:.0f} s to fail"


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """No bind(0) or connect() of another process hands out these ports (a parallel test run's gloo
    connections), so a launch's store finds its port still free."""
    low, high = spawn._ephemeral_ports()
    assert 1024 < low <= high
    ports = [free_port() for _ in range(8)]
    assert all(max(1024, low - 16384) <= p < low for p in ports), (ports, low)
    assert all(_binds(p) for p in ports) and len(set(ports)) > 1, ports


def test_free_port_takes_bind_0_where_nothing_lies_below_the_range(monkeypatch):
    monkeypatch.setattr(spawn, "_ephemeral_ports", lambda: (1024, 65535))
    port = free_port()
    assert port >= 1024 and _binds(port)
