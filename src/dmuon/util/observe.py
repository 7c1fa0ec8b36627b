"""What dmuon tells about itself: its logger and its profiler ranges.

**Logs.** Everything dmuon says goes to ``logging.getLogger("dmuon")``, which carries a
``NullHandler`` as a library's logger does: nothing is printed unless the application configures
logging (``logging.basicConfig(level=logging.INFO)`` shows the setup's summary on rank 0).
Warnings about the user's code go through :mod:`warnings`.

**Profiler ranges.** Every phase of dmuon's step runs inside a range named ``dmuon.<phase>``
(``torch.autograd.profiler.record_function``) on the thread that runs it, so a
``torch.profiler`` trace shows the launches inside backward, the exchange's hops, the owners' NS
batches, the returns, the applies and AdamW where they ran. While no profiler records
(:func:`dmuon.util.torch_compat.profiler_active`), :func:`phase` hands out one shared do-nothing
context and :func:`ranged` calls the function straight through: a ``record_function`` costs some
microseconds even with no profiler (it enters the dispatcher), this a read of one flag
(docs/benchmarks/2026-12-05-cpu-2core-xeon-profiler-ranges.md measures both). The NS worker's ranges
(``ns_in_backward``) are recorded where the profiler records every thread
(``experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True)``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, ContextManager, TypeVar

from torch.autograd.profiler import record_function

from dmuon.util.torch_compat import profiler_active

logger = logging.getLogger("dmuon")
"""dmuon's logger (a ``NullHandler`` by default: the application decides what is shown)."""
logger.addHandler(logging.NullHandler())

PREFIX = "dmuon."
"""Every range's name starts with it."""

_NOTHING = contextlib.nullcontext()

F = TypeVar("F", bound=Callable)


def phase(name: str) -> ContextManager:
    """A profiler range ``dmuon.<name>`` around a ``with`` block while a profiler records; a shared
    do-nothing context otherwise."""
    if not profiler_active():
        return _NOTHING
    return record_function(PREFIX + name)


def ranged(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function inside the profiler range ``dmuon.<name>``
    (:func:`phase`; straight through while no profiler records)."""
    full = PREFIX + name

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not profiler_active():
                return fn(*args, **kwargs)
            with record_function(full):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
