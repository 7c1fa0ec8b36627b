"""Measure-once choices for orthogonalisation, persisted in a JSON cache.

Two decisions are tuned, each per device, compute dtype, matrix shape and schedule
(:meth:`Autotuner.plan` tunes both jointly for a stack of ``B`` matrices):

* **method** — standard Newton–Schulz, the standard iteration computed in float32
  and rounded to the requested dtype (``"standard32"``; a candidate only for 16-bit
  dtypes: on CPUs without 16-bit matrix units it is several times faster than the
  16-bit iteration and, being the reference itself, more accurate), or Gram
  Newton–Schulz. Gram is eligible only if it passes an accuracy bar on a probe
  matrix with a decaying spectrum (its distance to the float32 standard result may
  not exceed the standard path's own distance in the requested dtype, nor 1e-3
  relative, whichever is larger); the faster eligible method wins.
* **batching** — for ``B`` same-shape matrices, one batched call or a loop of 2-D
  calls, for the chosen method. On CPU batching wins when per-call dispatch
  dominates (many small matrices) and can lose for mid-sized ones.

The cache is one JSON file per device fingerprint, torch version and schema version
(its header, which also names the file), under ``cache_dir`` (argument, else
``$DMUON_CACHE_DIR``, else ``~/.cache/dmuon``), kept with :mod:`dmuon.util.jsoncache`;
a file that does not parse, or whose header differs, is ignored (and replaced on the
next write), never trusted; writes are atomic. Processes sharing the
cache (the ranks of one host) measure one at a time under a lock file and re-read the
cache first, so each problem is measured once per host, on otherwise idle tuning
slots. Timing is :func:`dmuon.ortho.timing.time_candidates`: on CUDA device time from
CUDA events on a private stream, whose waits depend on nothing but the measured
kernels; elsewhere host time.

**Frozen tuning.** Inside :func:`frozen` (dmuon's runtime holds it around every
owner-work call of a step, backward's NS worker included; it tuned those problems
when it was built: :mod:`dmuon.runtime.tuning`) a tuner never measures and never
takes the lock: a verdict in memory (or in the file, read without the lock: writes
are atomic) is used, and a miss takes :data:`FROZEN_METHOD`, looped (:meth:`Autotuner.fallback`), with a warning
once per problem. Measuring there could deadlock: one rank would hold the host
lock while its device wait waits for a collective that another rank, waiting for
the lock, has not issued; and its figures would time the step's own traffic.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dmuon.util.jsoncache import (
    cache_file, default_cache_dir, file_lock, read_entries, resolve_cache_dir, write_entries,
)
from dmuon.util.observe import logger

from .coefficients import Schedule, schedule_key
from .gram import gram_newton_schulz
from .newton_schulz import newton_schulz
from .timing import device_fingerprint, measuring_stream, time_candidates

__all__ = [
    "ACCURACY_FLOOR", "FROZEN_METHOD", "METHODS", "PLAN_SLACK", "SCHEMA_VERSION", "Autotuner", "Problem",
    "default_cache_dir", "device_fingerprint", "frozen", "get_autotuner", "is_frozen", "run_looped", "run_method",
    "time_candidates",
]

SCHEMA_VERSION = 3  # 2: timings taken with BLAS threads matched to torch; 3: keys name the fp32 matmul precision
METHODS = ("standard", "standard32", "gram")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Relative error floor of the accuracy bar (see module docstring).
ACCURACY_FLOOR = 1e-3
# Stack timings only consider methods within this factor of the best single-matrix time.
PLAN_SLACK = 3.0
FROZEN_METHOD = "standard"
"""The method of a problem that has no verdict while tuning is frozen (:func:`frozen`), run looped:
torch.optim.Muon's own iteration on each matrix alone, so a matrix's result depends on nothing
but the matrix (not on this host's cache, its timings, or which matrices share its batch)."""

_frozen_depth = 0
_frozen_guard = threading.Lock()


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """No tuner of this process measures inside the block (any thread; nestable): see the module
    docstring, "Frozen tuning"."""
    global _frozen_depth
    with _frozen_guard:
        _frozen_depth += 1
    try:
        yield
    finally:
        with _frozen_guard:
            _frozen_depth -= 1


def is_frozen() -> bool:
    """Whether some thread of this process is inside :func:`frozen`."""
    return _frozen_depth > 0


@dataclass(frozen=True)
class Problem:
    """What a decision depends on."""

    device: str
    dtype: torch.dtype
    shape: tuple[int, int]
    schedule: tuple[tuple[float, float, float], ...]
    eps: float

    @property
    def steps(self) -> int:
        return len(self.schedule)

    def key(self, batch: int | None = None) -> str:
        dt = str(self.dtype).replace("torch.", "")
        # "high"/"medium" let float32 matmuls run TF32/bf16: a verdict timed under one
        # setting says nothing about the other.
        base = (f"{dt}|{self.shape[0]}x{self.shape[1]}|steps={self.steps}|sched={schedule_key(self.schedule)}"
                f"|fp32mm={torch.get_float32_matmul_precision()}")
        return base if batch is None else f"{base}|batch={batch}"


def run_method(method: str, G: torch.Tensor, problem: Problem) -> torch.Tensor:
    """Runs one method on a matrix or stack (the autotuner's and the API's runner)."""
    sched = tuple(tuple(t) for t in problem.schedule)  # hashable: resolved once (resolve_schedule's cache)
    if method == "standard":
        return newton_schulz(G, sched, problem.steps, problem.eps, problem.dtype)
    if method == "standard32":
        compute = torch.float64 if problem.dtype == torch.float64 else torch.float32
        return newton_schulz(G, sched, problem.steps, problem.eps, compute).to(problem.dtype)
    if method == "gram":
        return gram_newton_schulz(G, sched, problem.steps, problem.eps, problem.dtype)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def run_looped(method: str, G: torch.Tensor, problem: Problem) -> list[torch.Tensor]:
    return [run_method(method, g, problem) for g in G]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp(min=1e-300))


def _probe(shape: tuple[int, int], device: torch.device, batch: int = 1) -> torch.Tensor:
    """A reproducible gradient-like probe: low rank plus small noise."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    m, n = shape
    r = max(1, min(m, n) // 8)
    low = torch.randn(batch, m, r, generator=gen) @ torch.randn(batch, r, n, generator=gen)
    G = low / math.sqrt(r) + 1e-2 * torch.randn(batch, m, n, generator=gen)
    return G.to(device)


def _candidates(problem: Problem) -> tuple[str, ...]:
    """Methods worth timing for ``problem``: ``standard32`` only differs for 16-bit dtypes."""
    if problem.dtype in _LOW_PRECISION:
        return METHODS
    return tuple(m for m in METHODS if m != "standard32")


class Autotuner:
    """Decides method and batching per problem, measuring on a cache miss.

    Args:
        cache_dir: Directory of the JSON cache; ``None`` for :func:`default_cache_dir`.
        repeats: Timed repetitions per candidate (median is used).
        persist: Write measurements to disk (in-memory only when ``False``).
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, repeats: int = 3, persist: bool = True):
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self.cache_dir = resolve_cache_dir(cache_dir)
        self.repeats = repeats
        self.persist = persist
        self.measurements = 0  # number of measurement sessions run (for tests/diagnostics)
        self.frozen_misses = 0  # problems asked for while frozen with no verdict (each got the fallback)
        self._warned: set[str] = set()
        self.cooldown_s: float | None = None  # None: timing.default_cooldown_s (COOLDOWN_S on a multi-threaded CPU)
        self._files: dict[str, dict] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ storage

    def cache_path(self, device_fp: str) -> Path:
        # Named by the whole header: venvs of two torch releases sharing a cache directory each keep their file,
        # instead of replacing each other's verdicts at every switch (a file is trusted for its header only).
        return cache_file(self.cache_dir, "ortho-autotune", json.dumps(self._header(device_fp), sort_keys=True), 10)

    def _header(self, device_fp: str) -> dict:
        return {"schema": SCHEMA_VERSION, "torch": torch.__version__, "device": device_fp}

    def _entries(self, device_fp: str) -> dict:
        if device_fp not in self._files:
            self._files[device_fp] = self._read(device_fp)
        return self._files[device_fp]

    def _read(self, device_fp: str) -> dict:
        entries = read_entries(self.cache_path(device_fp), self._header(device_fp))
        return {k: v for k, v in entries.items() if isinstance(v, dict)}

    def _write(self, device_fp: str) -> None:
        # An unwritable cache directory is not an error: the decisions stay valid
        # in memory for this process.
        if self.persist:
            write_entries(self.cache_path(device_fp), self._header(device_fp), self._files.get(device_fp, {}))

    # ---------------------------------------------------------------- decisions

    def problem(self, shape, dtype: torch.dtype, device, schedule: Schedule, eps: float) -> Problem:
        return Problem(
            device_fingerprint(device), dtype, (int(shape[0]), int(shape[1])),
            tuple(tuple(float(v) for v in t) for t in schedule), float(eps),
        )

    @contextlib.contextmanager
    def _host_lock(self, device_fp: str) -> Iterator[None]:
        """Serialises measuring across the processes of one host that share the cache.

        Ranks on one machine would otherwise time candidates at the same moment on
        shared cores (skewing every measurement) and each redo the same work.
        """
        if not self.persist:
            yield
            return
        # Keyed by host: a home shared by a cluster's hosts holds one cache, but only a host's ranks share
        # cores and a device's neighbours; the hosts tune side by side, each under its own lock.
        with file_lock(self.cache_path(device_fp).with_suffix(f".{socket.gethostname()}.lock")):
            yield

    def _cached_or_measured(self, device_fp: str, key: str, valid: Callable[[object], bool],
                            measure: Callable[[], dict], fallback: dict) -> dict:
        entry = self._entries(device_fp).get(key)
        if valid(entry):
            return entry
        if is_frozen():
            # No lock, no file, no device wait: what is in memory, else the deterministic fallback.
            self.frozen_misses += 1
            if key not in self._warned:
                self._warned.add(key)
                chosen = ", ".join(f"{k}={v}" for k, v in fallback.items())
                warnings.warn(f"dmuon autotune: no verdict for {key} was measured before the step; using "
                              f"{chosen} (a step never measures)", RuntimeWarning, stacklevel=2)
            return fallback
        # Measuring holds the host lock: safe because no measurement runs inside a step (frozen()),
        # and its waits are on its own stream's events (CUDA) or none (CPU), never on another rank.
        with self._host_lock(device_fp):
            # Another process of this host may have measured it while we waited.
            self._files[device_fp] = {**self._files.get(device_fp, {}), **self._read(device_fp)}
            entries = self._entries(device_fp)
            entry = entries.get(key)
            if not valid(entry):
                start = time.perf_counter()
                entry = measure()
                logger.debug("autotune: measured %s on %s in %.2f s: %s", key, device_fp,
                            time.perf_counter() - start, entry)
                entries[key] = entry
                self._write(device_fp)
        return entry

    def method(self, problem: Problem, device: torch.device | str) -> str:
        """The method to use for one matrix of ``problem``'s shape."""
        device = torch.device(device)
        with self._lock:
            entry = self._cached_or_measured(
                problem.device, problem.key(),
                lambda e: isinstance(e, dict) and e.get("method") in METHODS,
                lambda: self._measure_method(problem, device),
                {"method": FROZEN_METHOD},
            )
            if device.type == "cuda" and entry.get("triton_tiles"):
                _pin_triton_tiles(entry["triton_tiles"])
            return entry["method"]

    def batching(self, problem: Problem, batch: int, method: str, device: torch.device | str) -> bool:
        """Whether ``batch`` matrices of ``problem``'s shape should run as one batched call."""
        if batch <= 1:
            return False
        device = torch.device(device)
        key = problem.key(batch) + f"|method={method}"
        with self._lock:
            entry = self._cached_or_measured(
                problem.device, key,
                lambda e: isinstance(e, dict) and isinstance(e.get("batched"), bool),
                lambda: self._measure_batching(problem, batch, method, device),
                {"batched": False},
            )
            return entry["batched"]

    def plan(
        self, problem: Problem, batch: int, device: torch.device | str, method: str | None = None
    ) -> tuple[str, bool]:
        """Method and batching for ``batch`` matrices of ``problem``'s shape.

        With ``method=None`` all eligible (method, batched/looped) combinations are
        timed on a stack of ``batch`` probes and the fastest wins, so the method can
        differ from the single-matrix choice (e.g. when one method batches better).

        Returns:
            ``(method, batched)``; ``batched`` is ``False`` for ``batch <= 1``.
        """
        if method is not None and method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
        if batch <= 1:
            return (method or self.method(problem, device)), False
        if method is not None:
            return method, self.batching(problem, batch, method, device)
        device = torch.device(device)
        with self._lock:
            self.method(problem, device)  # accuracy verdict for the shape, cached (none on a frozen miss)
            gram_ok = bool((self.lookup(problem) or {}).get("gram_accurate"))
            key = problem.key(batch) + "|method=auto"

            def valid(e) -> bool:
                return (isinstance(e, dict) and e.get("method") in METHODS
                        and isinstance(e.get("batched"), bool) and (gram_ok or e["method"] != "gram"))

            def measure() -> dict:
                # Methods already >PLAN_SLACK x slower than the best on one matrix are
                # not re-timed as stacks (on CPU that skips the 16-bit standard path,
                # whose timing would dominate the tuning).
                single = self.lookup(problem).get("times_s") or {}
                best = min(single.values(), default=0.0)
                methods = [m for m in _candidates(problem) if (gram_ok or m != "gram")
                           and (m not in single or single[m] <= PLAN_SLACK * best)]
                return self._measure_plan(problem, batch, methods, device)

            entry = self._cached_or_measured(problem.device, key, valid, measure, self.fallback(batch))
            return entry["method"], entry["batched"]

    @staticmethod
    def fallback(batch: int) -> dict:
        """The choice for ``batch`` matrices of a problem with no verdict while frozen:
        :data:`FROZEN_METHOD`, looped."""
        return {"method": FROZEN_METHOD, "batched": False}

    def lookup(self, problem: Problem, batch: int | None = None) -> dict | None:
        """The cached entry for a problem, without measuring."""
        return self._entries(problem.device).get(problem.key(batch))

    # -------------------------------------------------------------- measurement

    def _measure_method(self, problem: Problem, device: torch.device) -> dict:
        with measuring_stream(device):  # the accuracy runs' reads wait on this stream alone
            return self._measure_method_here(problem, device)

    def _measure_method_here(self, problem: Problem, device: torch.device) -> dict:
        self.measurements += 1
        G = _probe(problem.shape, device)[0]
        fp32 = Problem(problem.device, torch.float32 if problem.dtype != torch.float64 else torch.float64,
                       problem.shape, problem.schedule, problem.eps)
        reference = run_method("standard", G, fp32)
        std_err = _rel(run_method("standard", G, problem), reference)
        gram_err = _rel(run_method("gram", G, problem), reference)
        bar = max(std_err, ACCURACY_FLOOR)
        gram_ok = math.isfinite(gram_err) and gram_err <= bar
        candidates = {m: (lambda m=m: run_method(m, G, problem))
                      for m in _candidates(problem) if gram_ok or m != "gram"}
        times = time_candidates(candidates, device, self.repeats, cooldown_s=self.cooldown_s)
        method = min(times, key=times.get)
        entry = {"method": method, "times_s": times, "gram_error": gram_err, "standard_error": std_err,
                 "gram_accurate": gram_ok}
        if device.type == "cuda" and gram_ok:
            entry["triton_tiles"] = _triton_tiles(problem.shape)
        return entry

    def _measure_batching(self, problem: Problem, batch: int, method: str, device: torch.device) -> dict:
        self.measurements += 1
        G = _probe(problem.shape, device, batch)
        times = time_candidates(
            {"batched": lambda: run_method(method, G, problem), "looped": lambda: run_looped(method, G, problem)},
            device, self.repeats, cooldown_s=self.cooldown_s,
        )
        return {"batched": times["batched"] <= times["looped"], "times_s": times}

    def _measure_plan(self, problem: Problem, batch: int, methods, device: torch.device) -> dict:
        self.measurements += 1
        G = _probe(problem.shape, device, batch)
        candidates = {}
        for m in methods:
            candidates[f"{m}|batched"] = lambda m=m: run_method(m, G, problem)
            candidates[f"{m}|looped"] = lambda m=m: run_looped(m, G, problem)
        times = time_candidates(candidates, device, self.repeats, cooldown_s=self.cooldown_s)
        best = min(times, key=times.get)
        method, mode = best.split("|")
        return {"method": method, "batched": mode == "batched", "times_s": times}


def _triton_tiles(shape: tuple[int, int]) -> list:
    """The Triton SYRK tile configs autotuned for the Gram path of ``shape``."""
    try:
        from . import triton_syrk
    except Exception:  # pragma: no cover
        return []
    m, n = min(shape), max(shape)
    found = []
    for M, K in ((m, n), (m, m)):  # X Xᵀ, and the m x m squares of the inner loop
        cfg = triton_syrk.best_config(M, K)
        if cfg is not None:
            found.append([M, K, *cfg])
    return found


def _pin_triton_tiles(tiles) -> None:
    try:
        from . import triton_syrk

        for M, K, *cfg in tiles:
            triton_syrk.pin_config(int(M), int(K), tuple(int(v) for v in cfg))
    except Exception:
        # A malformed cached config is only a missed optimisation; autotuning redoes it.
        pass


_default: Autotuner | None = None
_default_lock = threading.Lock()
_default_env: tuple[str | None, str | None] | None = None


def get_autotuner() -> Autotuner:
    """The process-wide autotuner (cache directory from the environment)."""
    global _default, _default_env
    # The directory follows $DMUON_CACHE_DIR and $HOME (what default_cache_dir reads);
    # comparing them is cheaper than building the path on every NS call.
    env = (os.environ.get("DMUON_CACHE_DIR"), os.environ.get("HOME"))
    with _default_lock:
        if _default is None or env != _default_env:
            _default, _default_env = Autotuner(), env
        return _default
