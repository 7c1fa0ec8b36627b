"""Shared pytest setup for the dmuon.ortho tests."""

import pytest
import torch


def pytest_configure(config):
    # Registered here so `-m "not slow"` works before the project's pytest config exists.
    config.addinivalue_line("markers", "slow: large-matrix tests (minutes on a small CPU)")


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    # Other work shares this machine's cores; numerics do not depend on thread count
    # except for the bit-identity tests, which compare against torch under the same
    # setting.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



@pytest.fixture(autouse=True)
def _no_autotune_cooldown(monkeypatch):
    # The pause that keeps OpenBLAS spin from billing the next candidate matters for
    # real measurements, not for tests of the cache logic.
    from dmuon.ortho import timing

    monkeypatch.setattr(timing, "COOLDOWN_S", 0.0)
