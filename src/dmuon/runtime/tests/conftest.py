"""Fixtures of the runtime's unit tests (one process)."""

from __future__ import annotations

import pytest

from dmuon.comm import device_streams
from dmuon.testing.stream_check import CheckedStreams


@pytest.fixture
def checker():
    """The stream checker, started on this thread and made the process's active streams (what Pending
    records its events on); the streams before it restored after."""
    streams = CheckedStreams().start()
    try:
        with device_streams.installed(streams):
            yield streams
    finally:
        streams.stop()
