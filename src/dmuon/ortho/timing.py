"""Timing candidates on a device, and the name of the device the timings are filed under."""

from __future__ import annotations

import contextlib
import functools
import platform
import statistics
import time
from collections.abc import Callable, Iterator

import torch

# A candidate slower than this is timed once instead of ``repeats`` times.
SLOW_RUN_S = 0.5
# Upper bound on timed rounds for cheap candidates.
MAX_ROUNDS = 15
# Pause before timing each candidate on CPU with more than one thread (see time_candidates).
COOLDOWN_S = 0.2


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    # Read once per process: the autotuner asks for the fingerprint on every NS call.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_fingerprint(device: torch.device | str) -> str:
    """A string naming the device type and model (and CPU thread count), and the float32
    matmul precision (``torch.get_float32_matmul_precision()``: TF32 or not changes speed)."""
    dev = torch.device(device)
    fp32mm = f"fp32mm={torch.get_float32_matmul_precision()}"
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{torch.cuda.get_device_name(idx)}:{fp32mm}"
    if dev.type == "cpu":
        return f"cpu:{_cpu_name()}:threads={torch.get_num_threads()}:{fp32mm}"
    return f"{dev.type}:{fp32mm}"


def sync(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (a no-op off CUDA).

    The host clock's bracket (:func:`time_candidates` off CUDA). On CUDA the timing waits only
    for its own stream's events instead: a device-wide synchronize would also wait for every
    collective the rank has in flight, which another rank may not have issued yet.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def measuring_stream(device: torch.device) -> Iterator[None]:
    """Runs the block on a private stream of ``device`` (CUDA; elsewhere the block runs as is).

    The private stream first waits for the caller's current stream (where the probes were made),
    and the caller's stream waits for it at the end (nothing the block made is read before it is
    written). Work on it is ordered after nothing else: no other stream's kernel, no collective
    in flight, is waited for by an event recorded on it.
    """
    if device.type != "cuda":
        yield
        return
    caller = torch.cuda.current_stream(device)
    private = torch.cuda.Stream(device)
    private.wait_stream(caller)
    with torch.cuda.device(device), torch.cuda.stream(private):
        yield
    caller.wait_stream(private)


class _HostClock:
    """Host seconds of one call, the device's queue drained before and after (:func:`sync`): for
    devices without CUDA events (on CPU the call's own duration)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        fn()
        sync(self.device)
        return time.perf_counter() - t0


class _EventClock:
    """Device seconds of one call on CUDA: CUDA events recorded around it on the current stream
    (:func:`measuring_stream`'s private one), waited for alone (``Event.synchronize``), so the
    figure is the call's kernels and the wait never depends on another stream or another rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def default_cooldown_s(device: torch.device) -> float:
    """The pause before each candidate's block: :data:`COOLDOWN_S` on a CPU with more than one torch
    thread (another thread pool may still be spinning), else 0."""
    return COOLDOWN_S if device.type == "cpu" and torch.get_num_threads() > 1 else 0.0


def time_candidates(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, budget_s: float = 0.25,
    cooldown_s: float | None = None, stat: Callable[[list[float]], float] = statistics.median,
    adaptive: bool = True,
) -> dict[str, float]:
    """Seconds of each candidate (``stat`` of its timed calls), timed block by block.

    On CUDA the seconds are device time from CUDA events on a private stream
    (:func:`measuring_stream`, :class:`_EventClock`): the candidates' kernels, not the host's
    launch overhead, and no other stream's or rank's work; no device-wide synchronize. Elsewhere
    they are host time (:class:`_HostClock`).

    Each candidate gets a cool-down pause, one untimed warm-up call and then at
    least ``repeats`` timed calls. With ``adaptive`` (the autotuner's setting),
    cheap candidates get more calls, up to :data:`MAX_ROUNDS`, within about
    ``budget_s``: for millisecond problems a median of 3 is at the mercy of one
    scheduler hiccup; and a candidate whose warm-up took longer than
    :data:`SLOW_RUN_S` is timed once. Without it every candidate gets exactly
    ``repeats`` timed calls.

    Candidates are not interleaved on purpose: after a NumPy/OpenBLAS call the
    OpenBLAS worker threads keep spinning for ~0.1 s and slow down torch's own
    threads (measured: a 2-thread standard Newton–Schulz ran 1.7x slower right after
    a NumPy matmul). The pause before each block (``cooldown_s``, default
    :func:`default_cooldown_s`) lets them go idle, so one candidate does not bill its
    successor. With one torch thread there is no pool to spin: torch runs on the calling
    thread and NumPy's BLAS is held to torch's thread count
    (:func:`dmuon.ortho.symmetric.blas_threads`), so the default pause is 0 there, as it
    is off CPU (the ranks of a CPU run, one thread each, tune without sleeping).
    """
    if cooldown_s is None:
        cooldown_s = default_cooldown_s(device)
    clock = _EventClock(device) if device.type == "cuda" else _HostClock(device)
    out: dict[str, float] = {}
    with measuring_stream(device):
        for k, fn in fns.items():
            if cooldown_s > 0:
                time.sleep(cooldown_s)
            warm = clock(fn)
            if not adaptive:
                rounds = repeats
            elif warm > SLOW_RUN_S:
                rounds = 1
            else:
                rounds = max(1, repeats, min(MAX_ROUNDS, int(budget_s / max(warm, 1e-9))))
            out[k] = stat([clock(fn) for _ in range(rounds)])
    return out
