"""Which :class:`~dmuon.comm.streams.Streams` a process runs on: one per device, the checker's on request."""

from __future__ import annotations

import os
import threading

import torch

from dmuon.comm.stream_check import CheckedStreams
from dmuon.comm.streams import CudaStreams, HostStreams, Streams

__all__ = ["CHECK_ENV", "active", "install", "streams_for"]

_active: Streams | None = None
_by_device: dict[str, Streams] = {}
_registry_lock = threading.Lock()


CHECK_ENV = "DMUON_CHECK_STREAMS"
"""Set to 1 to run the CPU ranks of a process group under :class:`dmuon.comm.stream_check.CheckedStreams`
(the test suite does, for every rank it spawns; a process without a process group is left alone)."""


def streams_for(device: torch.device | str) -> Streams:
    """The process's streams of ``device`` (the checker's where one was installed, or on a CPU rank with
    ``$DMUON_CHECK_STREAMS=1``, started on the calling thread); also made :func:`active`."""
    global _active
    device = torch.device(device)
    with _registry_lock:
        key = str(device)
        if key not in _by_device:
            if device.type == "cuda":
                _by_device[key] = CudaStreams(device)
            elif os.environ.get(CHECK_ENV) == "1" and torch.distributed.is_available() and \
                    torch.distributed.is_initialized():
                _by_device[key] = CheckedStreams(device).start()
            else:
                _by_device[key] = HostStreams(device)
        _active = _by_device[key]
        return _active


def active() -> Streams:
    """The streams of the device this process's runtime runs on (host streams before any)."""
    global _active
    if _active is None:
        _active = HostStreams()
    return _active


def install(streams: Streams) -> Streams | None:
    """Makes ``streams`` the process's streams of its device (the checker, in tests); returns what it replaces."""
    global _active
    with _registry_lock:
        previous = _by_device.get(str(streams.device))
        _by_device[str(streams.device)] = streams
        _active = streams
        return previous
