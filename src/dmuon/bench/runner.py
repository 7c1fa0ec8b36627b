"""Runs one configuration on every rank and times its phases."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon.bench.memory import live_state_bytes
from dmuon.bench.models import build_workload
from dmuon.bench.setups import Hyper, build, clip_norm, reshard_after_forward
from dmuon.costmodel.traffic import fsdp2_traffic, replicate_all_reduce_traffic

LIVE_KINDS = ("params", "grads", "optimizer_state", "total")
"""The live-memory figures, per rank: unique storages of each kind, and of all three together."""
LIVE_POINTS = ("after_backward", "after_step")
"""Where in a training step the live memory is measured (after step: before ``zero_grad``)."""


@dataclass
class BenchOptions:
    """What to run; the same for every configuration."""

    model: str = "qwen2"
    """Workload name (see :func:`dmuon.bench.models.build_workload`)."""
    size: str | None = None
    """Workload size preset (``None``: the family's default, see
    :data:`dmuon.bench.models.DEFAULT_SIZES`)."""
    seq_len: int | None = None
    """Tokens per sample override."""
    batch_size: int | None = None
    """Samples per rank override."""
    steps: int = 4
    """Timed steps per configuration."""
    rounds: int = 2
    """Interleaved runs: the timed steps are taken in this many rounds through the configurations."""
    interleave: bool = True
    """Alternate the configurations' timed steps (see :func:`run_all`); False runs them one after another."""
    warmup: int = 1
    """Untimed steps first (autotuning and caches settle here, and the live memory is measured:
    with 0, on the timed steps instead)."""
    hsdp: int = 1
    """Replicas R: run on an R x (N/R) (replicate, shard) mesh when > 1."""
    tp: int = 1
    """Tensor-parallel degree T: a (dp, tp) mesh (with ``hsdp``: (replicate, shard, tp)), each
    block split by the workload's TP plan, FSDP2 over the rest; ranks of one tp group read the same data."""
    hyper: Hyper = field(default_factory=Hyper)
    """Optimizer settings."""
    progress: bool = True
    """Rank 0 prints a progress bar on stderr."""
    trace_dir: str | None = None
    """With it, after the timed steps, one more (untimed) step of each configuration runs under
    torch.profiler, every thread recorded, and each rank writes ``<trace_dir>/<config>-rank<k>.json``."""


def _proc_status_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _start_peak_rss() -> int:
    """Releases freed heap, resets the kernel's peak-RSS mark and returns the current RSS.

    Writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM`` (Linux >= 4.0), so
    configurations run one after another in one process get their own peaks.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss = _proc_status_bytes("VmRSS")
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss() -> int:
    peak = _proc_status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fsdp_bytes_per_step(model, blocks, world_size: int, replicate: int = 1, reshard_after_forward: bool = True,
                         tp: int = 1, all_reduce: bool = True) -> int:
    """Bytes one rank sends plus receives in FSDP2's collectives per step (from shapes).

    Each sharded parameter (every one: FSDP2 shards the Muon matrices too) is
    all-gathered for forward, and again for backward when
    ``reshard_after_forward`` (ZeRO-3 style; once with False, ZeRO-2 style) unless it is the
    root's own (not in one of ``blocks``: the root stays gathered from forward to backward,
    :func:`dmuon.bench.setups.shard_root`), and its gradient reduce-scattered once within the
    shard group; ring collectives move (S-1)/S of the tensor through every rank each way. HSDP adds a ring
    all-reduce of the gradient shard across the R replicas (2 (R-1)/R of the
    shard each way). See :func:`dmuon.costmodel.traffic.fsdp2_traffic`. With tensor
    parallelism FSDP2's groups are the ``S / tp`` dp ranks and each moves its tp
    rank's part of a parameter (TP's own collectives on activations are not counted).
    ``all_reduce=False``: FSDP2 over the shard dim only (dmuon's replicate level reduces across
    replicas, and counts those bytes as its own).
    """
    shard = world_size // (replicate * tp)
    if not all_reduce:
        replicate = 1
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    numels: dict[tuple[int, bool], list[int]] = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            regathered = reshard_after_forward and id(p) in in_blocks
            numels.setdefault((p.element_size(), regathered), []).append(
                p.to_local().numel() * shard if tp > 1 else p.numel())
    total = 0
    for (elem_bytes, regathered), sizes in numels.items():
        t = fsdp2_traffic(sizes, replicate, shard, elem_bytes=elem_bytes, reshard_after_forward=regathered)
        total += t.sent + t.received
    return total


def _progress(config: str, done: int, total: int) -> None:
    width = 24
    filled = width * done // total
    sys.stderr.write(f"\r  {config:<11} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class _ConfigRun:
    """One configuration's model, optimizer and measurements on this rank."""

    def __init__(self, rank: int, world_size: int, config: str, opts: BenchOptions, mesh, device: str):
        self.rank, self.world_size, self.config, self.opts, self.device = rank, world_size, config, opts, device
        self.rss_before = _start_peak_rss()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.device(device):
            self.workload = build_workload(opts.model, size=opts.size, seq_len=opts.seq_len,
                                           batch_size=opts.batch_size, seed=0)
        self.optimizer, self.plan = build(config, self.workload, mesh, opts.hyper)
        self.reshard_after_forward = reshard_after_forward(config)
        self.clip = clip_norm(config)
        self.kept: list[int] = []
        self.fwd_bwd: list[float] = []
        self.opt_s: list[float] = []
        self.opt_own_s: list[float] = []
        self.one_clock = _one_host(world_size)
        self.ns: list[float] = []
        self.sent: list[int] = []
        self.received: list[int] = []
        self.inter: list[int] = []
        self.round_of_step: list[int] = []
        self.losses: list[float] = []
        self.peak = 0
        # This rank's largest live bytes seen at each point of a step, per kind.
        self.live = {point: dict.fromkeys(LIVE_KINDS, 0) for point in LIVE_POINTS}

    def _measure_live(self, point: str) -> None:
        seen = self.live[point]
        for kind, nbytes in live_state_bytes(self.workload.model, self.optimizer).items():
            seen[kind] = max(seen[kind], nbytes)

    def _measures_live(self, timed: bool) -> bool:
        # Timed steps go straight from backward to step() to zero_grad, as training does: a
        # rank measuring (1-2 ms of Python on --size small) while another is still inside a
        # timed phase takes that rank's cores on an oversubscribed host. The state is the same
        # every step once the first has created it, so the untimed steps measure it.
        return not timed or self.opts.warmup == 0

    def _between_backward_and_step(self, timed: bool) -> None:
        """Untimed steps measure the live memory after backward here."""
        if self._measures_live(timed):
            self._measure_live("after_backward")

    def train_step(self, timed: bool, round_index: int = 0) -> None:
        """One forward, backward and optimizer step; records its times when ``timed``.

        On untimed steps (``timed=False``; with no warmup, every step) live memory
        is measured after backward and after ``step()`` (before ``zero_grad``),
        outside the timed spans. On one host the phases are
        timed on its clock, from the last rank's entry to the last rank's exit
        (forward+backward from the barrier, the optimizer from ``step()``, plus
        the slowest ``zero_grad``); across hosts, the slowest rank's own
        durations. Nothing is left in flight when ``step()`` returns (dmuon
        applies its updates inside it), so a step's times are complete when it
        ends, whichever configuration runs next.
        """
        loss, stamps = self._run_phases(timed)
        opt = self.optimizer
        stats = opt.last_step_stats() if hasattr(opt, "last_step_stats") else {}
        # The device's NS time (CUDA events; the host's on CPU): on CUDA the host only enqueues NS. Read
        # after the synchronize that ends the phases, so it waits for nothing.
        ns_seconds = (opt.last_step_report().ns_device_seconds if hasattr(opt, "last_step_report")
                      else stats.get("ns_seconds", 0.0))
        fwd_bwd, opt_s, own_opt, ns_s = self._phase_seconds(stamps, ns_seconds)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        self.losses.append(mean_loss.item() / self.world_size)
        if timed:
            self.fwd_bwd.append(fwd_bwd)
            self.opt_s.append(opt_s)
            self.opt_own_s.append(own_opt)
            self.ns.append(ns_s)
            self.sent.append(stats.get("bytes_sent", 0))
            self.received.append(stats.get("bytes_received", 0))
            self.inter.append(stats.get("inter_bytes_sent", 0) + stats.get("inter_bytes_received", 0))
            self.kept.append(stats.get("blocks_exchanged_in_backward", 0))
            self.round_of_step.append(round_index)

    def traced_step(self) -> str:
        """One untimed step under torch.profiler (CPU, and CUDA on a GPU; every thread, so dmuon's NS worker
        too), written as a Chrome trace; its path."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
            self.train_step(timed=False)
        self.losses.pop()  # the results are the timed run's
        os.makedirs(self.opts.trace_dir, exist_ok=True)
        path = os.path.join(self.opts.trace_dir, f"{self.config}-rank{self.rank}.json")
        prof.export_chrome_trace(path)
        return path

    def _synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _run_phases(self, timed: bool) -> tuple[torch.Tensor, list[float]]:
        """Forward and backward from a barrier, ``step()`` (with the config's clip) and ``zero_grad``, each
        ended by a synchronize; the loss and the clock stamps ``t0``-``t5`` around them (live memory
        measured between the stamps)."""
        # The ranks of one tp group are one data-parallel rank: they read the same batch.
        batch = self.workload.make_batch(len(self.losses), self.rank // self.opts.tp)
        if self.device == "cuda":
            batch = {k: v.to(self.device) for k, v in batch.items()} if isinstance(batch, dict) else batch
        dist.barrier()
        t0 = time.perf_counter()
        loss = self.workload.loss_fn(self.workload.model, batch)
        loss.backward()
        self._synchronize()
        t1 = time.perf_counter()
        self._between_backward_and_step(timed)
        t2 = time.perf_counter()
        if self.clip is not None:
            # What training scripts do (torch's own clip), timed with the optimizer.
            torch.nn.utils.clip_grad_norm_(self.workload.model.parameters(), self.clip)
        self.optimizer.step()
        self._synchronize()
        t3 = time.perf_counter()
        if self._measures_live(timed):
            self._measure_live("after_step")
        t4 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self._synchronize()
        t5 = time.perf_counter()
        return loss, [t0, t1, t2, t3, t4, t5]

    def _phase_seconds(self, stamps: list[float], ns_seconds: float) -> tuple[float, float, float, float]:
        """Forward+backward and optimizer seconds of the step, the slowest rank's own optimizer seconds and
        NS seconds (a collective call)."""
        t0, t1, t2, t3, t4, t5 = stamps
        # Maxima over ranks of the clock stamps, and of each rank's own phase durations.
        times = torch.tensor([t0, t1, t2, t3, t5 - t4, t1 - t0, (t3 - t2) + (t5 - t4), ns_seconds],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        last_start, last_backward, last_entry, last_exit, zero_grad_s, own_fwd_bwd, own_opt, ns_s = times.tolist()
        if self.one_clock:
            # A phase lasts from the moment its last rank enters it to the moment its last
            # rank leaves it: what it adds to the step's critical path. A rank that enters
            # step() early and waits there for a rank still in backward is not charged to the optimizer.
            return last_backward - last_start, last_exit - last_entry + zero_grad_s, own_opt, ns_s
        # Hosts' clocks differ: each rank's own durations, the slowest rank's.
        return own_fwd_bwd, own_opt, own_opt, ns_s

    def record_peak(self) -> None:
        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else _peak_rss() - self.rss_before
        peak_t = torch.tensor([peak], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        self.peak = int(peak_t.item())

    def live_bytes(self) -> dict[str, dict[str, int]]:
        """The live bytes per point and kind, each the maximum over ranks (a collective call)."""
        values = torch.tensor([self.live[p][k] for p in LIVE_POINTS for k in LIVE_KINDS],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        flat = iter(int(v) for v in values.tolist())
        return {p: {k: next(flat) for k in LIVE_KINDS} for p in LIVE_POINTS}

    def _by_round(self, times: list[float], rounds: list[int]) -> list[float]:
        """The median of ``times`` (one per timed step) within each of ``rounds``."""
        return [statistics.median(t for t, r in zip(times, self.round_of_step) if r == k) for k in rounds]

    def result(self) -> dict:
        world_size, config, model = self.world_size, self.config, self.workload.model
        steps = [a + b for a, b in zip(self.fwd_bwd, self.opt_s)]
        sent, received, inter = self.sent, self.received, self.inter
        opt_bytes = (statistics.median(sent) + statistics.median(received)) if sent else 0
        if config == "torch_muon":
            # DTensor gathers each matrix for NS; count it as the gather baseline moves it
            # (in NS's input dtype: torch.optim.Muon casts to bfloat16 before NS).
            opt_bytes = sum(2 * p.numel() * torch.bfloat16.itemsize * (world_size - 1) // world_size
                            for g in self.optimizer.opts[0].param_groups for p in g["params"])
        if config.startswith("ddp_"):
            # torch's DDP: a ring all-reduce of every gradient across the N replicas (counted in bytes).
            ring = replicate_all_reduce_traffic([p.numel() * p.element_size() for p in model.parameters()
                                                 if p.requires_grad], world_size, 1, elem_bytes=1)
            fsdp_bytes = ring.inter_sent + ring.inter_received
        else:
            fsdp_bytes = _fsdp_bytes_per_step(model, self.workload.blocks, world_size, self.opts.hsdp,
                                              self.reshard_after_forward, self.opts.tp,
                                              all_reduce=not (self.plan is not None and self.plan.replicate_level))
        live = self.live_bytes()
        balance = self.plan.balance_result if self.plan is not None else None
        rounds = sorted(set(self.round_of_step))
        return {
            "config": config,
            "step_s": statistics.median(steps),
            "step_s_min": min(steps),
            "step_s_max": max(steps),
            "step_s_all": steps,
            "step_s_by_round": self._by_round(steps, rounds),
            "fwd_bwd_s_by_round": self._by_round(self.fwd_bwd, rounds),
            "optimizer_s_by_round": self._by_round(self.opt_s, rounds),
            "optimizer_s": statistics.median(self.opt_s),
            # The slowest rank's own step() + zero_grad duration (waits for late ranks included).
            "optimizer_own_s": statistics.median(self.opt_own_s),
            "phases_on_one_clock": self.one_clock,
            "fwd_bwd_s": statistics.median(self.fwd_bwd),
            "ns_s": statistics.median(self.ns),
            "bytes_per_step": int(fsdp_bytes + opt_bytes),
            "fsdp_bytes_per_step": int(fsdp_bytes),
            "optimizer_bytes_per_step": int(opt_bytes),
            "peak_mem_bytes": self.peak,
            # Measured live training state (max over ranks), at its larger point and at both.
            "live_mem_bytes": max(live.values(), key=lambda v: v["total"]),
            "live_mem_bytes_by_point": live,
            "reshard_after_forward": self.reshard_after_forward,
            "final_loss": self.losses[-1],
            "inter_bytes_per_step": int(statistics.median(inter)) if inter else 0,
            # dmuon: the launches from backward step() kept, per timed step (rank 0's), of the plan's blocks.
            "kept_launches_per_step": list(self.kept),
            # No launches under torch's DDP (its gradients exist only once backward ends): nothing to report.
            "blocks": len(self.plan.blocks) if self.plan is not None and not self.plan.ddp else 0,
            "losses": self.losses,
            "tokens_per_rank": self.workload.tokens_per_rank,
            "imbalance": self.plan.imbalance() if self.plan is not None else None,
            # The balancer's own figures: seconds with --profile, FLOPs with the analytical model.
            "plan_makespan": balance.makespan if balance is not None else None,
            "plan_mean": balance.mean if balance is not None else None,
        }


def _one_host(world_size: int) -> bool:
    """Whether every rank runs on this host, so their ``time.perf_counter()`` stamps share one clock."""
    names: list[str | None] = [None] * world_size
    dist.all_gather_object(names, socket.gethostname())
    return len(set(names)) == 1


def _device() -> str:
    return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"


def _mesh(device: str, world_size: int, opts: BenchOptions):
    if opts.tp > 1:
        if opts.hsdp > 1:
            return init_device_mesh(device, (opts.hsdp, world_size // (opts.hsdp * opts.tp), opts.tp),
                                    mesh_dim_names=("replicate", "shard", "tp"))
        return init_device_mesh(device, (world_size // opts.tp, opts.tp), mesh_dim_names=("dp", "tp"))
    if opts.hsdp > 1:
        return init_device_mesh(device, (opts.hsdp, world_size // opts.hsdp), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world_size,))


def round_sizes(steps: int, rounds: int) -> list[int]:
    """Timed steps per round: ``steps`` split as evenly as possible over ``rounds``."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (1 if k < steps % rounds else 0) for k in range(rounds)]


def run_config(rank: int, world_size: int, config: str, opts: BenchOptions) -> dict:
    """Trains ``opts.model`` with ``config`` for warmup+steps and reports timings (rank 0's view)."""
    device = _device()
    run = _ConfigRun(rank, world_size, config, opts, _mesh(device, world_size, opts), device)
    total = opts.warmup + opts.steps
    for step in range(total):
        run.train_step(timed=step >= opts.warmup)
        if rank == 0 and opts.progress:
            _progress(config, step + 1, total)
    run.record_peak()
    if opts.trace_dir is not None:
        run.traced_step()
    return run.result()


def _run_interleaved(rank: int, world_size: int, configs: list[str], opts: BenchOptions) -> list[dict]:
    device = _device()
    mesh = _mesh(device, world_size, opts)
    runs = []
    # Build and warm up one at a time, so each peak-memory figure is its own.
    for config in configs:
        run = _ConfigRun(rank, world_size, config, opts, mesh, device)
        for step in range(opts.warmup):
            run.train_step(timed=False)
            if rank == 0 and opts.progress:
                _progress(config, step + 1, opts.warmup)
        run.record_peak()
        runs.append(run)
        dist.barrier()
    sizes = round_sizes(opts.steps, opts.rounds)
    for k, size in enumerate(sizes):
        for run in runs:
            for _ in range(size):
                run.train_step(timed=True, round_index=k)
        if rank == 0 and opts.progress:
            _progress("timed", k + 1, len(sizes))
    if opts.trace_dir is not None:
        for run in runs:
            run.traced_step()
    return [run.result() for run in runs]


def _prime(rank: int, world_size: int, opts: BenchOptions) -> None:
    """One untimed FSDP2 + AdamW step, then freed.

    The first training step in a process pays one-time costs (lazy imports,
    autograd and gloo buffers, allocator arenas) that would otherwise land in
    the first measured configuration's peak memory.
    """
    device = _device()
    run = _ConfigRun(rank, world_size, "adamw", opts, _mesh(device, world_size, opts), device)
    run.train_step(timed=False)
    del run
    _start_peak_rss()
    dist.barrier()


def run_all(rank: int, world_size: int, configs: list[str], opts: BenchOptions) -> list[dict]:
    """Runs every configuration in this process group.

    Interleaved (default): all configurations are built and warmed up first,
    then the timed steps run in rounds, each round giving every configuration
    its share in turn, so slow drifts of the machine's speed (other tenants,
    clocks) fall on all of them alike. Sequential: one configuration after
    another, each freed before the next (for models too big to hold several).
    """
    _prime(rank, world_size, opts)
    if opts.interleave:
        return _run_interleaved(rank, world_size, configs, opts)
    out = []
    for config in configs:
        result = run_config(rank, world_size, config, opts)
        out.append(result)
        dist.barrier()
    return out
