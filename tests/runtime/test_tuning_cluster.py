"""Tuning at build on a cluster: a lock per host, a file system without locks, the wait on the store."""

from __future__ import annotations

import errno
import logging
import socket
import time

from dmuon.ortho import autotune
from dmuon.runtime import setup_log, tuning
from dmuon.util import jsoncache

from support.spawn import run_distributed


def test_the_tuning_lock_is_the_hosts(tmp_path, monkeypatch):
    """Cluster rule: a home shared by every host holds one cache, but only one host's ranks share its
    cores and devices: the lock that serializes measuring is keyed by host, so hosts tune side by side."""
    taken = []
    monkeypatch.setattr(autotune, "file_lock", lambda path: taken.append(path) or jsoncache.file_lock(path))
    tuner = autotune.Autotuner(cache_dir=tmp_path)
    with tuner._host_lock("fp"):
        pass
    assert [p.name for p in taken] == [tuner.cache_path("fp").with_suffix(f".{socket.gethostname()}.lock").name]
    assert socket.gethostname() in taken[0].name


def test_a_file_system_without_locks_tunes_unlocked_and_says_so_once(tmp_path, monkeypatch, caplog):
    """Cluster rule: flock on NFS or Lustre mounted without locks raises (ENOLCK); construction must
    not fail: the block runs without the lock and the setup log says so once."""
    def no_locks(handle, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(jsoncache.fcntl, "flock", no_locks)
    monkeypatch.setattr(jsoncache, "UNLOCKED", [])
    monkeypatch.setattr(setup_log, "_said_unlocked", False)
    ran = []
    for _ in range(2):
        with jsoncache.file_lock(tmp_path / "x.lock"):
            ran.append(True)
    assert ran == [True, True] and len(jsoncache.UNLOCKED) == 1 and "No locks" in jsoncache.UNLOCKED[0]

    class Plan:  # what log_setup reads on a rank other than 0
        rank = 1

    with caplog.at_level(logging.WARNING, logger="dmuon"):
        setup_log.log_setup(Plan(), 0, 0.0)
        setup_log.log_setup(Plan(), 0, 0.0)
    said = [r for r in caplog.records if "without the host's lock" in r.getMessage()]
    assert len(said) == 1


def _tune_unevenly(rank: int, world_size: int) -> dict:
    start = time.perf_counter()
    if rank == 1:
        time.sleep(1.0)  # the host's second rank tunes after the first
    spread = tuning.wait_for_tuning(tuple(range(world_size)))
    waited = time.perf_counter() - start
    # A second runtime on the same ranks waits under its own keys (no stale key lets it through).
    start = time.perf_counter()
    if rank == 0:
        time.sleep(0.5)
    again = tuning.wait_for_tuning(tuple(range(world_size)))
    return {"spread": spread, "waited": waited, "again": again, "waited_again": time.perf_counter() - start}


def test_ranks_wait_for_each_others_tuning_on_the_store():
    """NCCL rule: a rank waiting inside a collective is timed by the watchdog (300 s is common), while
    the host's other ranks tune one by one under its lock: the ranks wait for each other's end of
    tuning on the store instead, and the spread between the first and the last is measured."""
    results = run_distributed(_tune_unevenly, 2)
    for r in results:
        assert r["waited"] >= 0.9 and 0.9 <= r["spread"] < 5.0, r
        assert r["waited_again"] >= 0.4 and 0.4 <= r["again"] < 5.0, r
