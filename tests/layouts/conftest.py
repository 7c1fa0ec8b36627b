"""Settings for the layout tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The test process's own torch work (the one-process references, the checks) on one thread, as every
    rank runs: their ops are tiny, and on a loaded 2-core machine torch's intra-op threads wait for each other
    at every op (tests/layouts/test_examples.py measured the experts' reference at 7.5 s on two threads, 0.4 s
    on one, under load 30). The count before is restored after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
