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
    previous_active, previous = device_streams._active, device_streams.install(streams)
    try:
        yield streams
    finally:
        device_streams._active = previous_active
        if previous is None:
            device_streams._by_device.pop(str(streams.device), None)
        else:
            device_streams._by_device[str(streams.device)] = previous
        streams.stop()
