"""Counting the operations a code path dispatches, on plain tensors and on DTensors.

:class:`~dmuon.costmodel.host.HostOps` holds such counts for the step simulation; this is how they
are taken (``src/dmuon/bench/tests/test_host_ops.py`` recounts them against the code)."""

from __future__ import annotations

import collections
import contextlib

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class OpCounter(TorchDispatchMode):
    """Counts each top-level operation once: one with a DTensor argument as ``"dtensor"`` (the local
    operation DTensor runs inside it is not seen again: the mode is off inside its own handler),
    any other as ``"plain"``. :meth:`paused` leaves a stretch uncounted (the owners' NS, priced apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self._on = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._on:
            flat, _ = tree_flatten((args, kwargs))
            kind = "dtensor" if any(isinstance(a, DTensor) for a in flat) else "plain"
            self.counts[kind] += 1
            self.by_op[(str(func), kind)] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def paused(self):
        on, self._on = self._on, False
        try:
            yield
        finally:
            self._on = on

    def wrap_paused(self, fn):
        """``fn`` run uncounted."""
        def run(*args, **kwargs):
            with self.paused():
                return fn(*args, **kwargs)
        return run
