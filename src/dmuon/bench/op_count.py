"""Counting the operations a code path dispatches, on plain tensors and on DTensors, and the
reads of tensor values into Python among them.

:class:`~dmuon.costmodel.host.HostOps` holds such counts for the step simulation; this is how they
are taken (``src/dmuon/bench/tests/test_host_ops.py`` recounts them against the code).
:class:`HostReadCounter` counts the reads (``tests/runtime/test_host_reads.py``, ``dmuon bench --gpu-check``'s
dry run)."""

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


HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"})
"""The operations that read a tensor's value into Python (``.item()``, ``bool(t)``, ``int(t)``,
``torch.equal``): on an accelerator each waits for the device to finish what is queued before it."""


class HostReadCounter(TorchDispatchMode):
    """Counts :data:`HOST_READS`, except reads of the tensors in ``ignored`` (by storage:
    torch.optim's step counters, which live on the host, so reading them waits for nothing).

    ``.tolist()``, ``.cpu()`` and ``.numpy()`` of a CPU tensor dispatch nothing, so they are not
    seen; on CUDA, ``torch.cuda.set_sync_debug_mode`` sees every synchronizing call (the GPU check)."""

    def __init__(self, ignored=()) -> None:
        super().__init__()
        self.ignored = {t.data_ptr() for t in ignored}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS and not (args and args[0].data_ptr() in self.ignored):
            self.count += 1
        return func(*args, **(kwargs or {}))
