"""Settings for the runtime's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """One intra-op thread in the test's own process while it runs, as in each rank it spawns: the math done
    here (one-process references, single-process optimizers) is small, and where the ranks and other jobs
    already fill the cores, a second OpenMP thread spins waiting for the first (the one-process reference of
    tests/support/equivalence.py: 0.05 s with one thread, 0.5 s to 27 s with two, on 2 loaded cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
