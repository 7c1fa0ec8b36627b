"""Streams, events, collectives in flight and device entry: every one dmuon uses goes through here.

dmuon's work runs on four kinds of stream (CUDA; docs/architecture.md, "Streams"):

* **FSDP2's post-reduce stream** (its reduce-scatter stream; on native HSDP its all-reduce
  stream): FSDP2 calls post-accumulate-grad hooks under it, so a launch's ``peek``, the send
  buffer's copy and the issue of the first hop run there. dmuon never makes it *wait*: a wait
  there would queue FSDP2's next reduce-scatter behind dmuon's exchange.
* **dmuon's own stream** (``own("dmuon")``): what hooks land and issue after the first hop
  (the later hops, the replicate level's reductions) runs there, forked from the hook's stream.
* **the NS stream** (``own("ns")``): the NS worker thread's, where a launch's exchange lands and
  the owners' work of ``ns_in_backward`` runs.
* **the compute stream** (the default stream): forward, backward and ``step()``. ``step()``
  lands what it consumes there.

A hand-over between streams is an event recorded where the data was produced and waited on
where it is consumed (:meth:`Streams.record`, :meth:`Streams.wait`); a buffer used on a stream
other than the one that allocated it is kept for that stream (:meth:`Streams.keep`, CUDA's
``record_stream``) before its last reference goes. A collective's buffers are held by its
:class:`Flight` until it lands, and kept for the landing stream then: NCCL drops its own
references at the first ``wait()``, while the copy may still be on the wire for another stream.

Three implementations: :class:`HostStreams` (CPU: no streams, ``wait()`` blocks the host),
:class:`CudaStreams`, and :class:`dmuon.testing.stream_check.CheckedStreams`, a CPU implementation
that emulates CUDA's placement with logical streams and raises on any unordered use;
:mod:`dmuon.comm.device_streams` picks the process's.
Whether a rank enters a collective never depends on an event's, a timer's or a lock's state:
nothing here decides what is issued, only where it is waited for.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["CudaStreams", "Flight", "HostStreams", "Interval", "Streams", "kept"]


class Flight:
    """A collective in flight: its work handle and every buffer it reads or writes, held until it lands.

    ``wait()`` lands it for the caller's current stream (:meth:`Streams.land`); later calls do nothing.
    """

    def __init__(self, streams: "Streams", work: Any, buffers: tuple[torch.Tensor, ...], token: Any = None) -> None:
        self.streams = streams
        self.work = work
        self.buffers = buffers
        self.token = token
        """What the implementation tracks the collective by (the checker's)."""
        self.landed = False

    def wait(self) -> bool:
        self.streams.land(self)
        return True


class Interval:
    """A span of work on the current stream: the host's seconds always, and the device's where it
    times its streams (CUDA events); read :attr:`device_seconds` after the step, never inside it."""

    def __init__(self, start: Any = None) -> None:
        self.host_seconds = 0.0
        self._start = start
        self._end: Any = None

    @property
    def device_seconds(self) -> float:
        """The device's time between the span's two events (waits for the second); the host's without events."""
        if self._start is None:
            return self.host_seconds
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class Streams(abc.ABC):
    """The interface (see the module docstring); one instance per process and device."""

    device: torch.device

    @contextlib.contextmanager
    def interval(self) -> Iterator[Interval]:
        """Times the block: host seconds (on CPU also the work's), and on CUDA the current stream's."""
        span = Interval(self._timing_event())
        start = time.perf_counter()
        yield span
        span.host_seconds = time.perf_counter() - start
        span._end = self._timing_event()

    def _timing_event(self) -> Any:
        return None

    @abc.abstractmethod
    def current(self) -> Any:
        """The calling thread's current stream."""

    @abc.abstractmethod
    def own(self, name: str) -> Any:
        """dmuon's own stream ``name`` (``"dmuon"``, ``"ns"``), created once."""

    @abc.abstractmethod
    def use(self, stream: Any, fork: bool = True) -> contextlib.AbstractContextManager[None]:
        """Runs the block on ``stream``. With ``fork`` it first waits for the stream it replaces: what
        was enqueued there before is visible inside; without, only events order its inputs (the NS
        worker's stream must not wait for the backward compute queued on the default stream)."""

    def enter(self) -> None:
        """A new thread enters this device (a thread starts on device 0)."""

    @abc.abstractmethod
    def record(self) -> Any:
        """An event at this point of the current stream."""

    @abc.abstractmethod
    def wait(self, event: Any) -> None:
        """The current stream waits for ``event``."""

    def issue(self, collective: Callable[[], Any], reads: Iterable[torch.Tensor],
              writes: Iterable[torch.Tensor]) -> Flight:
        """Issues ``collective`` (an ``async_op=True`` call) from the current stream; its handle
        holds ``reads`` and ``writes`` until it lands."""
        reads, writes = tuple(reads), tuple(writes)
        token = self._issuing(reads, writes)
        return Flight(self, collective(), reads + writes, token)

    def _issuing(self, reads: tuple[torch.Tensor, ...], writes: tuple[torch.Tensor, ...]) -> Any:
        """Before a collective is issued (the checker places it); what its :class:`Flight` is tracked by."""
        return None

    def land(self, flight: Flight) -> None:
        """The current stream waits for the collective; its buffers are kept for this stream."""
        if flight.landed:
            return
        self._landing(flight)
        flight.work.wait()
        self._landed(flight)
        # NCCL dropped its references at wait(); the copy may still be in flight for this stream.
        self.keep(flight.buffers)
        flight.landed = True
        flight.work, flight.buffers = None, ()

    def _landing(self, flight: Flight) -> None:
        """Before the current stream waits for ``flight`` (the checker checks where the wait lands)."""

    def _landed(self, flight: Flight) -> None:
        """Once the current stream has waited for ``flight`` (the checker orders the streams)."""

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` are used on the current stream: their memory is not reused by the stream
        that allocated them before this stream's work so far has run."""

    @contextlib.contextmanager
    def fsdp2_hook(self) -> Iterator[None]:
        """Around dmuon's post-accumulate-grad hook: FSDP2 already runs it on its post-reduce stream
        (the checker emulates that placement)."""
        yield

    def sync(self) -> None:
        """Waits for every stream of the device (setup and measurement only, never inside a step)."""


class HostStreams(Streams):
    """CPU: one stream, ``wait()`` blocks the host; events and keeps are nothing."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def current(self) -> Any:
        return None

    def own(self, name: str) -> Any:
        return None

    @contextlib.contextmanager
    def use(self, stream: Any, fork: bool = True) -> Iterator[None]:
        yield

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        return None


class CudaStreams(Streams):
    """CUDA streams and events of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._own: dict[str, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def own(self, name: str) -> torch.cuda.Stream:
        with self._lock:
            if name not in self._own:
                self._own[name] = torch.cuda.Stream(device=self.device)
            return self._own[name]

    @contextlib.contextmanager
    def use(self, stream: torch.cuda.Stream, fork: bool = True) -> Iterator[None]:
        if fork:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def enter(self) -> None:
        torch.cuda.set_device(self.device)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        stream = torch.cuda.current_stream(self.device)
        for t in tensors:
            if t.device.type == "cuda" and t.untyped_storage().nbytes():
                t.record_stream(stream)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def _timing_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event


def kept(result: Any) -> list[torch.Tensor]:
    """The tensors of a result (a tensor, or a dict/list/tuple of them), for :meth:`Streams.keep`."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        return [t for v in result.values() for t in kept(v)]
    if isinstance(result, (list, tuple)):
        return [t for v in result for t in kept(v)]
    return []
