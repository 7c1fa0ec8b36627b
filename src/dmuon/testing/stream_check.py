"""A CPU implementation of :mod:`dmuon.comm.streams` that checks dmuon's stream discipline.

On CPU there are no streams: gloo's ``wait()`` blocks the host and every op runs in
program order, so a missing event or an early free can never show. This implementation
gives each piece of work the stream it has on CUDA, as *logical* streams, and raises
:class:`StreamOrderError` on any use a CUDA run could get wrong:

* **Placement** (as FSDP2 and dmuon place work on CUDA): the main thread runs on
  ``"compute"`` (forward, backward, ``step()``). FSDP2 places its own work through its
  device handle (``torch.cpu`` here: ``stream(s)``, ``Stream.wait_stream``,
  ``Stream.record_event``, ``current_stream().wait_event``), which the checker turns into
  logical streams ``"fsdp2:k"``: FSDP2's all-gathers, reduce-scatters and post-reduce work
  (with the hooks it calls there) run, and are ordered, as on CUDA (the source followed is
  torch 2.13's ``_fsdp_collectives``/``_fsdp_param_group``); ``use(own(name))`` runs on ``name``; a collective runs on a stream of
  its own, forked from the stream that issued it (NCCL's stream waits for it).
* **Order**: each stream keeps a vector clock. Events carry the recording stream's clock
  to the waiting stream; landing a collective carries the collective's clock. A read of a
  buffer last written on another stream, or a write over another stream's read or write,
  with no such edge, raises naming the buffer, both streams and the ops. A storage made
  before the checker started (FSDP2's sharded parameters, a model's buffers) is ordered
  from its first use under the checker on.
* **Memory** (CUDA's caching allocator): a buffer freed while a stream other than the one
  that allocated it may still use it (no :meth:`~dmuon.comm.streams.Streams.keep` for that
  stream, no edge from it back to the allocating stream) is reusable by the allocating
  stream's next allocation: that allocation raises unless the allocating stream has waited
  since. (Not for a storage made before the checker started: which pool it came from is
  unknown.)
* **Waits**: a wait on FSDP2's stream, or on the compute stream while backward runs,
  raises (it would queue FSDP2's reduce-scatters, or backward's compute, behind dmuon).
* **Threads**: a thread other than the one that installed the checker must
  :meth:`~dmuon.comm.streams.Streams.enter` the device before using streams (a new thread
  starts on CUDA device 0).

Every op is seen through a ``TorchDispatchMode`` (DTensors by their local tensors;
``c10d`` ops only through :meth:`issue`). What it cannot see: NCCL's own timing and the
allocator's real pools; the GPU check runs the same paths on a GPU.

One file past 500 lines: the checker is one state machine (its clocks, buffers and the torch patches that
feed them), read together.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon.comm.streams import Flight, Streams
from dmuon.util.torch_compat import in_backward, queue_end_of_backward

__all__ = ["CheckedStreams", "StreamOrderError"]

COMPUTE = "compute"
FSDP2 = "fsdp2"


class StreamOrderError(RuntimeError):
    """A use of a buffer, a wait or a free that CUDA's streams would not order."""


@dataclass
class _Buffer:
    name: str
    allocated_on: str | None
    """None: made before the checker started (ordered, never tracked for reuse)."""
    write: tuple[str, int, str] | None = None
    """(stream, clock, op) of the last write."""
    reads: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per stream, the (clock, op) of its latest read since the last write."""
    kept: set[str] = field(default_factory=set)


@dataclass
class _Event:
    stream: str
    clock: dict[str, int]


class _Mode(TorchDispatchMode):
    def __init__(self, checker: "CheckedStreams") -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            return func(*args, **kwargs)  # a collective's buffers are declared through issue()
        out = func(*args, **kwargs)
        self.checker._op(func, args, kwargs, out)
        return out


def _local(t: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    inner = getattr(t, "_local_tensor", None)  # a DTensor: its storage is the local tensor's
    return inner if isinstance(inner, torch.Tensor) else t


def _tensors(value: Any, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors (a DTensor's local one) in ``value``, a tensor or a nested list/tuple of them, except
    tensors on the meta device."""
    found = [] if into is None else into
    if isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, found)
        return found
    t = value if type(value) is torch.Tensor else _local(value)  # a plain tensor: most of what an op sees
    if t is not None and not t.is_meta:
        found.append(t)
    return found


@dataclass(frozen=True)
class _Signature:
    """What :meth:`CheckedStreams._op` reads of an op's schema, worked out once per op."""

    name: str
    arguments: tuple[tuple[int, str, bool], ...]
    """(position, keyword, written) of each argument whose type can hold a tensor."""
    returns: int
    fresh_returns: tuple[int, ...]
    """The positions of the returns that alias no argument (new storage, or an existing one returned)."""

    @staticmethod
    def of(func: Any) -> "_Signature":
        schema = func._schema
        arguments = tuple((k, arg.name, arg.alias_info is not None and arg.alias_info.is_write)
                          for k, arg in enumerate(schema.arguments) if "Tensor" in str(arg.type))
        fresh = tuple(k for k, ret in enumerate(schema.returns) if ret.alias_info is None)
        return _Signature(str(func), arguments, len(schema.returns), fresh)


def _key(t: torch.Tensor) -> int | None:
    """The buffer's identity: its storage object's (one Python object per storage, alive as long as the
    storage; FSDP2 frees and refills the same storage with ``resize_``, as it does on CUDA)."""
    try:
        return id(t.untyped_storage())
    except RuntimeError:  # a wrapper subclass without storage of its own
        return None


def _clock_of(event: Any) -> dict[str, int] | None:
    """The vector clock an event carries: a checker's :class:`_Event`'s, or the one
    ``torch.cpu.Event.record`` left on it (None: never recorded under the checker)."""
    return event.clock if isinstance(event, _Event) else getattr(event, "_dmuon_clock", None)


class CheckedStreams(Streams):
    """The checking implementation (see the module docstring); :meth:`start` installs it on this thread."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._clocks: dict[str, dict[str, int]] = {}
        self._buffers: dict[int, _Buffer] = {}
        self._watched: dict[int, weakref.ref] = {}
        """The weak reference to each tracked storage (its callback releases the buffer)."""
        self._signatures: dict[Any, _Signature] = {}
        self._freed: dict[str, list[tuple[str, list[tuple[str, int, str]]]]] = {}
        """Per allocating stream, the buffers freed while other streams might still use them."""
        self._pending_errors: list[str] = []
        self._collectives = 0
        self._fsdp2_streams = 0
        self._emulated_finalize = False
        self._landed_collectives: set[str] = set()
        self._in_backward = False
        self.waits: collections.Counter = collections.Counter()
        """Per (waiting stream, stream whose event it waited for), how many :meth:`wait` calls (joins):
        what a test counts where a wait's place matters (a wait on the compute stream holds up the work
        queued behind it)."""
        self._tls = threading.local()
        self._home = threading.get_ident()
        self._mode = _Mode(self)
        self._patched: list[tuple[Any, str, Any]] = []
        self.trace = os.environ.get("DMUON_CHECK_STREAMS_TRACE") == "1"
        """Name each buffer by the stack that allocated it (slow)."""

    # ----------------------------------------------------------------- setup
    def start(self) -> "CheckedStreams":
        """Checks every op of this thread from now on and emulates FSDP2's stream placement."""
        self._home = threading.get_ident()
        self._tls.entered = True
        self._mode.__enter__()
        self._patch_fsdp2()
        return self

    def stop(self) -> None:
        self._mode.__exit__(None, None, None)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        self.raise_pending()

    def _patch_fsdp2(self) -> None:
        """FSDP2 places its work with ``device_handle.stream(s)``, ``s.wait_stream``, ``s.record_event``
        and ``current_stream().wait_event`` on every device; on CPU those are ``torch.cpu``'s no-ops.
        They become logical streams here, so FSDP2's own ordering is emulated as it runs on CUDA."""
        import torch.cpu as cpu
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self._patch_streams(cpu)
        self._patch_events(cpu)
        self._patch_finalize_backward(FSDPParamGroup)

    def _patch(self, owner: Any, attr: str, value: Any) -> None:
        """Sets ``owner.attr`` to ``value`` until :meth:`stop` puts the original back."""
        self._patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def _fsdp2_stream(self, stream: Any) -> str:
        """The logical stream of one of FSDP2's ``torch.cpu.Stream`` objects (named on first sight)."""
        name = getattr(stream, "_dmuon_stream", None)
        if name is None:
            with self._lock:
                self._fsdp2_streams += 1
                name = stream._dmuon_stream = f"{FSDP2}:{self._fsdp2_streams}"
        return name

    def _patch_streams(self, cpu: Any) -> None:
        """``torch.cpu.current_stream``/``stream`` and ``Stream.wait_stream``/``record_event``/``wait_event``."""
        checker = self
        proxies: dict[str, Any] = {}

        def current_stream(device=None):
            name = checker._here()
            if name not in proxies:
                proxy = cpu.Stream.__new__(cpu.Stream)
                proxy._dmuon_stream = name
                proxies[name] = proxy
            return proxies[name]

        def stream(s):
            return checker._on(checker._fsdp2_stream(s))

        def wait_stream(s, other) -> None:
            with checker._lock:
                checker._join(checker._fsdp2_stream(s), checker._clock(checker._fsdp2_stream(other)))

        def record_event(s) -> _Event:
            with checker._lock:
                return _Event(checker._fsdp2_stream(s), dict(checker._clock(checker._fsdp2_stream(s))))

        def wait_event(s, event) -> None:
            clock = _clock_of(event)
            if clock is not None:
                with checker._lock:
                    checker._join(checker._fsdp2_stream(s), clock)

        self._patch(cpu, "current_stream", current_stream)
        self._patch(cpu, "stream", stream)
        self._patch(cpu.Stream, "wait_stream", wait_stream)
        self._patch(cpu.Stream, "record_event", record_event)
        self._patch(cpu.Stream, "wait_event", wait_event)

    def _patch_events(self, cpu: Any) -> None:
        """``torch.cpu.Event.record``/``wait``: the event carries the recording stream's clock."""
        checker = self

        def event_record(event, stream=None) -> None:
            name = checker._here() if stream is None else checker._fsdp2_stream(stream)
            with checker._lock:
                event._dmuon_clock = dict(checker._clock(name))

        def event_wait(event, stream=None) -> None:
            clock = _clock_of(event)
            if clock is not None:
                name = checker._here() if stream is None else checker._fsdp2_stream(stream)
                with checker._lock:
                    checker._join(name, clock)

        self._patch(cpu.Event, "record", event_record)
        self._patch(cpu.Event, "wait", event_wait)

    def _patch_finalize_backward(self, group_class: type) -> None:
        """``FSDPParamGroup.finalize_backward``: backward ends there (from then on a wait on the
        compute stream no longer queues backward's compute)."""
        checker = self
        original = group_class.finalize_backward

        def finalize_backward(group, *args, **kwargs):
            result = original(group, *args, **kwargs)  # waits for the post-reduce events (emulated above)
            checker._in_backward = False
            return result

        self._patch(group_class, "finalize_backward", finalize_backward)

    def raise_pending(self) -> None:
        if self._pending_errors:
            errors, self._pending_errors = self._pending_errors, []
            raise StreamOrderError("\n".join(errors))

    # ---------------------------------------------------------------- clocks
    def _clock(self, stream: str) -> dict[str, int]:
        return self._clocks.setdefault(stream, {stream: 0})

    def _tick(self, stream: str) -> int:
        clock = self._clock(stream)
        clock[stream] += 1
        return clock[stream]

    def _join(self, stream: str, other: dict[str, int]) -> None:
        clock = self._clock(stream)
        for s, c in other.items():
            if clock.get(s, 0) < c:
                clock[s] = c

    def _sees(self, stream: str, other: str, at: int) -> bool:
        return other == stream or self._clock(stream).get(other, 0) >= at

    def _stack(self) -> list[str]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = [COMPUTE]
        return self._tls.stack

    @contextlib.contextmanager
    def _on(self, stream: str) -> Iterator[None]:
        """This thread's current stream is ``stream`` inside the block."""
        stack = self._stack()
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def _here(self) -> str:
        if threading.get_ident() != self._home and not getattr(self._tls, "entered", False):
            raise StreamOrderError(f"thread {threading.current_thread().name!r} uses the device's streams without "
                                   "entering the device first (Streams.enter: a new thread starts on CUDA device 0)")
        return self._stack()[-1]

    # ------------------------------------------------------------ the interface
    def current(self) -> str:
        return self._here()

    def own(self, name: str) -> str:
        return name

    @contextlib.contextmanager
    def use(self, stream: str, fork: bool = True) -> Iterator[None]:
        with self._lock:
            before = self._here()
            if fork:
                self._join(stream, self._clock(before))
        with self._on(stream):
            yield

    def enter(self) -> None:
        self._tls.entered = True
        self._mode.__enter__()  # this thread's ops are checked too (the mode stack is per thread)

    def record(self) -> _Event:
        with self._lock:
            stream = self._here()
            return _Event(stream, dict(self._clock(stream)))

    def wait(self, event: _Event | None) -> None:
        with self._lock:
            stream = self._here()
            if event is None:
                return
            self._check_may_wait(stream, f"an event of stream {event.stream!r}")
            self.waits[(stream, event.stream)] += 1
            self._join(stream, event.clock)

    def _issuing(self, reads: tuple[torch.Tensor, ...], writes: tuple[torch.Tensor, ...]) -> str:
        with self._lock:
            stream = self._here()
            self._collectives += 1
            name = f"collective#{self._collectives}"
            self._join(name, self._clock(stream))  # NCCL's stream waits for the issuing one
            self._tick(name)
            for t in _tensors(reads):
                self._access(t, name, False, name)
            for t in _tensors(writes):
                self._access(t, name, True, name)
            return name

    def _landing(self, flight: Flight) -> None:
        with self._lock:
            self._check_may_wait(self._here(), f"{flight.token}")

    def _landed(self, flight: Flight) -> None:
        with self._lock:
            self._join(self._here(), self._clock(flight.token))
            self._landed_collectives.add(flight.token)

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            stream = self._here()
            for t in _tensors(list(tensors)):
                key = _key(t)
                if key is not None and key in self._buffers:
                    self._buffers[key].kept.add(stream)

    @contextlib.contextmanager
    def fsdp2_hook(self) -> Iterator[None]:
        self._in_backward = True
        if self._here().startswith(FSDP2):  # FSDP2 placed it on its post-reduce stream already
            yield
            return
        with self._lock:  # a hook FSDP2 did not call: placed as FSDP2 would
            # FSDP2's reduce-scatter stream waited for the compute stream before reducing this gradient,
            # and the post-reduce stream wrote the gradient the hook reads.
            self._join(FSDP2, self._clock(COMPUTE))
            self._tick(FSDP2)
            if not self._emulated_finalize:
                # And at the end of backward FSDP2's finalize_backward makes the compute stream wait.
                try:
                    queue_end_of_backward(self._finalize)
                    self._emulated_finalize = True
                except RuntimeError:
                    pass  # called outside a backward pass (the checker's own tests): nothing ends it
        with self._on(FSDP2):
            yield

    def _finalize(self) -> None:
        """The end of a backward whose hooks FSDP2 did not call: what its finalize_backward would do."""
        with self._lock:
            self._join(COMPUTE, self._clock(FSDP2))
            self._in_backward = False
            self._emulated_finalize = False

    # ------------------------------------------------------------ the checks
    def _check_may_wait(self, stream: str, what: str) -> None:
        if stream.startswith(FSDP2):
            raise StreamOrderError(f"a wait for {what} lands on FSDP2's post-reduce stream: FSDP2's next "
                                   "reduce-scatter would queue behind it")
        # Outside autograd (FSDP2's reduction called by hand, as pipeline schedules do) no backward
        # compute is queued on the compute stream for a wait to hold up.
        if stream == COMPUTE and self._in_backward and in_backward():
            raise StreamOrderError(f"a wait for {what} lands on the compute stream during backward: backward's "
                                   "compute would queue behind it")

    def _op(self, func, args, kwargs, out) -> None:
        signature = self._signatures.get(func)
        if signature is None:
            signature = self._signatures[func] = _Signature.of(func)
        with self._lock:
            if self._pending_errors:
                self.raise_pending()
            stream = self._here()
            clock = self._tick(stream)
            op = signature.name
            if self.trace:
                op += " at\n" + "".join(traceback.format_stack(limit=12)[:-3])
            given = len(args)
            for k, keyword, written in signature.arguments:
                value = args[k] if k < given else kwargs.get(keyword)
                if value is None:
                    continue
                for t in _tensors(value):
                    if t.numel():  # an empty view moves no byte on a GPU either
                        self._access(t, stream, written, op, clock)
            if signature.fresh_returns:
                # One return may be a list (a foreach op's Tensor[]); several come as a tuple.
                outs = (out,) if signature.returns == 1 else out
                for k in signature.fresh_returns:
                    for t in _tensors(outs[k]):
                        self._allocated(t, stream, op, clock)

    def _access(self, t: torch.Tensor, stream: str, written: bool, op: str, clock: int | None = None) -> None:
        key = _key(t)
        if key is None:
            return
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._untracked(t, key)
        at = clock if clock is not None else self._clock(stream)[stream]
        if buf.write is not None:
            w_stream, w_clock, w_op = buf.write
            if not self._sees(stream, w_stream, w_clock):
                raise StreamOrderError(
                    f"buffer {buf.name} was written on stream {w_stream!r} ({w_op}) and is "
                    f"{'written' if written else 'read'} on stream {stream!r} ({op}) with no event or wait "
                    "ordering them")
        if written:
            for r_stream, (r_clock, r_op) in buf.reads.items():
                if not self._sees(stream, r_stream, r_clock):
                    raise StreamOrderError(
                        f"buffer {buf.name} is written on stream {stream!r} ({op}) while stream {r_stream!r} may "
                        f"still be reading it ({r_op}): no event or wait orders them")
            buf.write = (stream, at, op)
            buf.reads = {}
        else:
            buf.reads[stream] = (at, op)

    def _untracked(self, t: torch.Tensor, key: int) -> _Buffer:
        """A storage first seen in use, not allocated under the checker (made before it started: FSDP2's
        sharded parameters, a model's buffers): ordered from now on like any other, but never handed to
        a stream's next allocation (which stream's pool it came from is unknown)."""
        nbytes = t.untyped_storage().nbytes()
        name = f"{str(t.dtype).removeprefix('torch.')}[{nbytes} bytes] made before the checker started"
        if self.trace:
            name += ", first used at\n" + "".join(traceback.format_stack(limit=14)[:-4])
        buf = self._buffers[key] = _Buffer(name, None)
        self._watch(t, key)
        return buf

    def _allocated(self, t: torch.Tensor, stream: str, op: str, clock: int) -> None:
        key = _key(t)
        if key is None or key in self._buffers:
            return  # an op that returned an existing storage
        self._reused_memory(stream)
        name = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} from {op}"
        if self.trace:
            name += " allocated at\n" + "".join(traceback.format_stack(limit=14)[:-4])
        self._buffers[key] = _Buffer(name, stream, (stream, clock, op))
        self._watch(t, key)

    def _watch(self, t: torch.Tensor, key: int) -> None:
        """Calls :meth:`_released` when ``t``'s storage goes (a weak reference's callback: the storage's id
        cannot be reused before it runs)."""
        self._watched[key] = weakref.ref(t.untyped_storage(), lambda _ref, key=key: self._released(key))

    def _released(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)
            buf = self._buffers.pop(key, None)
            if buf is None:
                return
            accesses = ([buf.write] if buf.write is not None else []) + [(s, c, o) for s, (c, o) in buf.reads.items()]
            open_uses = [(s, c, o) for s, c, o in accesses
                         if s != buf.allocated_on and not any(self._sees(k, s, c) for k in buf.kept)]
            unlanded = sorted({s for s, _, _ in open_uses if s.startswith("collective#")} - self._landed_collectives)
            if unlanded:
                # Dropped with its collective never waited for: no stream is ordered after it, ever.
                self._pending_errors.append(f"buffer {buf.name} was released while {', '.join(unlanded)}, which "
                                            "uses it, was never landed (no stream waited for it)")
            if open_uses and buf.allocated_on is not None:
                name = buf.name
                if self.trace:
                    name += "\nfreed at\n" + "".join(traceback.format_stack(limit=14)[:-2])
                self._freed.setdefault(buf.allocated_on, []).append((name, open_uses))

    def _reused_memory(self, stream: str) -> None:
        """``stream`` allocates: any buffer it freed may come back now, so every other stream's use of
        one must be ordered before this point."""
        freed = self._freed.pop(stream, [])
        for name, uses in freed:
            for s, c, op in uses:
                if not self._sees(stream, s, c):
                    raise StreamOrderError(
                        f"buffer {name} allocated on stream {stream!r} was freed while stream {s!r} may still use "
                        f"it ({op}), and {stream!r} allocates again before waiting for {s!r}: keep it for "
                        f"{s!r} (Streams.keep) or hold it until {stream!r} has waited")
