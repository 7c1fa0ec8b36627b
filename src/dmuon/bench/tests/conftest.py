"""Test setup for the bench workloads."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Runs each test here with one intra-op thread (tiny models; avoids
    oversubscribing shared CPUs), restoring the previous setting afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
