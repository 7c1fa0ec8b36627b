"""Timing candidates on a device, and the name of the device the timings are filed under."""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch

# A candidate slower than this is timed once instead of ``repeats`` times.
SLOW_RUN_S = 0.5
# Upper bound on timed rounds for cheap candidates.
MAX_ROUNDS = 15
# Pause before timing each candidate on CPU (see time_candidates).
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
    """Waits for the work queued on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_candidates(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, budget_s: float = 0.25,
    cooldown_s: float | None = None, stat: Callable[[list[float]], float] = statistics.median,
    adaptive: bool = True,
) -> dict[str, float]:
    """Wall time in seconds of each candidate (``stat`` of its timed calls), timed block by block.

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
    :data:`COOLDOWN_S` on CPU, 0 elsewhere) lets them go idle, so one candidate does
    not bill its successor.
    """
    if cooldown_s is None:
        cooldown_s = COOLDOWN_S if device.type == "cpu" else 0.0
    out: dict[str, float] = {}
    for k, fn in fns.items():
        if cooldown_s > 0:
            time.sleep(cooldown_s)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        warm = time.perf_counter() - t0
        if not adaptive:
            rounds = repeats
        elif warm > SLOW_RUN_S:
            rounds = 1
        else:
            rounds = max(1, repeats, min(MAX_ROUNDS, int(budget_s / max(warm, 1e-9))))
        times = []
        for _ in range(rounds):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        out[k] = stat(times)
    return out
