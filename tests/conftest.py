"""Settings for the tests under tests/ (the package's own unit tests, src/dmuon/*/tests, keep torch's threads)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The test process's own torch work (one-process references, single-process optimizers, the checks) on
    one intra-op thread, as every rank it spawns runs: those ops are tiny, and where the ranks and other jobs
    already fill the cores, torch's second OpenMP thread spins waiting for the first at every op (the
    one-process reference of tests/support/equivalence.py: 0.05 s on one thread, 0.5 s to 27 s on two, on 2
    loaded cores). The count before is restored after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
