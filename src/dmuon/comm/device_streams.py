"""Which :class:`~dmuon.comm.streams.Streams` a process runs on: one per device, a tool's on request."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from dmuon.comm.streams import CudaStreams, HostStreams, Streams

__all__ = ["active", "install", "install_cpu_streams", "installed", "streams_for"]

_active: Streams | None = None
_by_device: dict[str, Streams] = {}
_registry_lock = threading.Lock()
_cpu_streams: Callable[[torch.device], Streams] = HostStreams
"""What builds a CPU device's streams: :class:`HostStreams` unless a tool installed its own."""


def streams_for(device: torch.device | str) -> Streams:
    """The process's streams of ``device`` (built on the calling thread at its first call: the installed
    CPU streams, such as the test tools' checker, start on the thread that runs the runtime); also made
    :func:`active`."""
    global _active
    device = torch.device(device)
    with _registry_lock:
        key = str(device)
        if key not in _by_device:
            _by_device[key] = CudaStreams(device) if device.type == "cuda" else _cpu_streams(device)
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


@contextlib.contextmanager
def installed(streams: Streams) -> Iterator[Streams]:
    """:func:`install` for the ``with`` block only: the streams of the device and the active ones as they
    were are put back after it (a tool's checker for one test in a process that goes on)."""
    global _active
    previous_active, previous = _active, install(streams)
    try:
        yield streams
    finally:
        with _registry_lock:
            _active = previous_active
            if previous is None:
                _by_device.pop(str(streams.device), None)
            else:
                _by_device[str(streams.device)] = previous


def install_cpu_streams(build: Callable[[torch.device], Streams] | None) -> None:
    """Makes ``build(device)`` the streams of each CPU device this process's runtime uses from now on
    (:func:`dmuon.testing.install_checker_from_env` installs the stream checker so in a test's ranks);
    None: :class:`HostStreams` again. Streams already built are dropped, so the next use builds anew."""
    global _active, _cpu_streams
    with _registry_lock:
        _cpu_streams = HostStreams if build is None else build
        for key in [k for k, s in _by_device.items() if s.device.type == "cpu"]:
            del _by_device[key]
        if _active is not None and _active.device.type == "cpu":
            _active = None
