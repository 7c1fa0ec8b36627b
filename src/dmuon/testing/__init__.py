"""dmuon.testing: tools for testing programs that use dmuon; the library itself never imports them.

* :mod:`~dmuon.testing.spawn`: run a function on N local gloo ranks and collect what each returns
  (also how ``dmuon bench`` and the examples launch local ranks).
* :mod:`~dmuon.testing.stream_check`: :class:`~dmuon.testing.stream_check.CheckedStreams`, a CPU
  implementation of dmuon's streams that emulates CUDA's placement and raises on any unordered use.
  It patches torch's modules while it runs, so it is installed only where asked for:
  :func:`install_checker_from_env` in each rank :mod:`~dmuon.testing.spawn` starts.
"""

from __future__ import annotations

import os

import torch

__all__ = ["CHECK_ENV", "install_checker_from_env"]

CHECK_ENV = "DMUON_CHECK_STREAMS"
"""Set to 1 to run a process group's CPU ranks under the stream checker (tests/conftest.py sets it for
the tests whose point is stream order)."""


def install_checker_from_env() -> bool:
    """Where ``$DMUON_CHECK_STREAMS`` is 1 and a process group is up, makes the stream checker this
    process's CPU streams (started by the first runtime that asks for them, on its thread); else installs
    nothing. Returns whether it installed."""
    if os.environ.get(CHECK_ENV) != "1" or not (torch.distributed.is_available()
                                                and torch.distributed.is_initialized()):
        return False
    from dmuon.comm import device_streams
    from dmuon.testing.stream_check import CheckedStreams

    device_streams.install_cpu_streams(lambda device: CheckedStreams(device).start())
    return True
