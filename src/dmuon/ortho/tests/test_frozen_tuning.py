"""Frozen tuning (dmuon.ortho.autotune.frozen): verdicts read, never measured, no lock taken."""

import contextlib
import threading

import pytest
import torch

from dmuon.ortho import autotune as at
from dmuon.ortho.api import orthogonalize_many
from dmuon.ortho.autotune import Autotuner
from dmuon.ortho.coefficients import KELLER, resolve_schedule

SCHED = resolve_schedule(KELLER, 5)


def _no_lock(monkeypatch):
    @contextlib.contextmanager
    def refuse(path):
        raise AssertionError(f"the host lock {path} was taken while tuning was frozen")
        yield

    monkeypatch.setattr(at, "file_lock", refuse)


def test_a_frozen_miss_takes_the_fallback_without_measuring_or_locking(tmp_path, monkeypatch):
    tuner = Autotuner(tmp_path, repeats=1)
    p = tuner.problem((12, 20), torch.bfloat16, "cpu", SCHED, 1e-7)
    _no_lock(monkeypatch)
    with at.frozen(), pytest.warns(RuntimeWarning, match="never measures"):
        assert tuner.plan(p, 3, "cpu") == (at.FROZEN_METHOD, False)
    with at.frozen():
        assert tuner.method(p, "cpu") == at.FROZEN_METHOD
        assert tuner.plan(p, 3, "cpu", method="gram") == ("gram", False)
    assert tuner.measurements == 0 and tuner.frozen_misses >= 3
    assert not list(tmp_path.iterdir())  # nothing written
    assert not at.is_frozen()


def test_frozen_reads_verdicts_measured_before(tmp_path, monkeypatch):
    tuner = Autotuner(tmp_path, repeats=1)
    p = tuner.problem((12, 20), torch.float32, "cpu", SCHED, 1e-7)
    chosen = tuner.plan(p, 3, "cpu")
    measured = tuner.measurements
    fresh = Autotuner(tmp_path, repeats=1)  # another process of the host: reads the file
    _no_lock(monkeypatch)
    with at.frozen():
        assert fresh.plan(p, 3, "cpu") == chosen
        assert tuner.plan(p, 3, "cpu") == chosen
    assert fresh.measurements == 0 and fresh.frozen_misses == 0 and tuner.measurements == measured


def test_frozen_covers_every_thread_and_nests():
    seen = []
    with at.frozen():
        with at.frozen():
            pass
        t = threading.Thread(target=lambda: seen.append(at.is_frozen()))
        t.start()
        t.join()
        assert at.is_frozen()
    assert seen == [True] and not at.is_frozen()


def test_fallback_is_each_matrix_alone_with_standard_ns(tmp_path):
    # The fallback's result for a matrix depends on that matrix only: looped standard NS.
    tuner = Autotuner(tmp_path, repeats=1)
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(12, 20, generator=gen) for _ in range(3)]
    with at.frozen(), pytest.warns(RuntimeWarning):
        got = orthogonalize_many(mats, method="auto", dtype=torch.float32, autotuner=tuner)
    alone = [orthogonalize_many([m], method="standard", batching="looped", dtype=torch.float32)[0] for m in mats]
    assert all(torch.equal(a, b) for a, b in zip(got, alone))
    assert tuner.measurements == 0
