"""A rank that raises mid-backward, its NS worker waiting, exits by the interpreter's own shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dmuon.testing.spawn import free_port

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, support's folder
_RANK = """
import sys
from datetime import timedelta
import torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
from support import faults
faults.raise_mid_backward_with_the_worker_waiting(rank, world)
"""


def test_a_rank_raising_mid_backward_exits_with_its_worker_waiting():
    """CUDA/NCCL rule: a rank's failure reaches its peers only when its process ends (NCCL's
    communicators die with it; until then they wait for its collectives, up to the watchdog's
    timeout). The NS worker, blocked on a hop the raising main thread will never issue, must not
    keep the interpreter from exiting: concurrent.futures joins its threads at exit, a daemon is
    left where it waits."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_TESTS, os.path.join(os.path.dirname(_TESTS), "src"),
                                                        os.environ.get("PYTHONPATH", "")]))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), "2", port], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE if rank == 1 else subprocess.DEVNULL, text=True)
             for rank in range(2)]
    try:
        deadline = time.monotonic() + 60.0  # setup (imports, groups, the first step) included
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        exited_at = time.time()
        exited = procs[1].poll() is not None
        if not exited:
            procs[1].kill()
        err = procs[1].communicate()[1]
        waiting = next((line for line in err.splitlines() if line.startswith("worker waiting in")), "")
        assert "pending.py:wait" in waiting, f"the worker was not waiting for a hop: {waiting!r}\n{err[-3000:]}"
        assert "injected failure inside backward" in err, err[-3000:]
        assert exited, f"rank 1 raised but did not exit\n{err[-3000:]}"
        assert procs[1].returncode == 1, procs[1].returncode
        raised_at = float(waiting.rsplit(" at ", 1)[1])
        assert exited_at - raised_at < 10.0, f"rank 1 exited {exited_at - raised_at:.1f} s after it raised"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_closing_wakes_a_worker_waiting_for_a_hop_and_stops_it():
    """CUDA/NCCL rule: only the main thread issues collectives (every rank in one order), so the NS
    worker waits on the host for the main thread to issue an exchange's next hop. At teardown
    (``close()``, as the runtime's) that hop will never come: the waiting worker raises and its
    thread ends, instead of waiting forever."""
    from dmuon.comm.pending import Pending, no_result
    from dmuon.comm.stats import CommStats
    from dmuon.runtime.worker import DaemonWorker

    second = Pending([], no_result, CommStats())
    first = Pending([], no_result, CommStats(), then=lambda: second)
    worker = DaemonWorker("dmuon-ns-test")
    assert worker.thread.daemon
    waited = worker.submit(first.wait, False)
    time.sleep(0.2)
    assert not waited.done()  # waiting for the main thread's forward()
    first.abandon()
    worker.shutdown()
    with pytest.raises(RuntimeError, match="abandoned"):
        waited.result(timeout=5.0)
    worker.thread.join(timeout=5.0)
    assert not worker.thread.is_alive()
