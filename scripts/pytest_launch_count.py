"""A pytest plugin counting the suite's rank launches, for tests/README.md's account of the default run's time.

    PYTHONPATH=scripts python -m pytest -q --durations=60 -p pytest_launch_count

prints, after the run, the launches by world size, the wall time spent inside them, and what an empty
4-rank launch costs on this machine (three of them, after the run). Under pytest-xdist each worker counts
its own launches and hands them to the controller, which prints the sum.
"""

from __future__ import annotations

import collections
import time

import pytest

COUNT: collections.Counter = collections.Counter()
WALL = [0.0]


def _nothing(rank: int, world_size: int) -> int:
    return rank


def pytest_configure(config):
    import dmuon.testing.spawn as spawn
    import support.spawn as tests_spawn

    launch = spawn.run_distributed

    def counted(fn, world_size, *args, **kwargs):
        COUNT[world_size] += 1
        start = time.perf_counter()
        try:
            return launch(fn, world_size, *args, **kwargs)
        finally:
            WALL[0] += time.perf_counter() - start

    spawn.run_distributed = counted
    crashing = tests_spawn.run_with_crashes

    def counted_crashing(fn, world_size, *args, **kwargs):
        COUNT[f"{world_size} (crash test)"] += 1
        return crashing(fn, world_size, *args, **kwargs)

    tests_spawn.run_with_crashes = counted_crashing


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set on a pytest-xdist worker only
    if workeroutput is not None:
        workeroutput["launches"] = {str(k): v for k, v in COUNT.items()}
        workeroutput["launch_wall"] = WALL[0]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's counts, added to this process's."""
    output = getattr(node, "workeroutput", {})
    for world, count in output.get("launches", {}).items():
        COUNT[int(world) if world.isdigit() else world] += count
    WALL[0] += output.get("launch_wall", 0.0)


def pytest_terminal_summary(terminalreporter):
    import dmuon.testing.spawn as spawn

    counted, inside = dict(COUNT), WALL[0]
    empty = []
    for _ in range(3):
        start = time.perf_counter()
        spawn.run_distributed(_nothing, 4)
        empty.append(time.perf_counter() - start)
    terminalreporter.write_line(f"launches by world size: {counted}; {sum(counted.values())} in all, "
                                f"{inside:.1f} s inside them; an empty 4-rank launch: "
                                + ", ".join(f"{s:.2f} s" for s in empty))
