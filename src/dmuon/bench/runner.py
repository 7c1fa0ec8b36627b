"""Runs one configuration on every rank and times its phases."""

from __future__ import annotations

import ctypes
import gc
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon.bench.models import build_workload
from dmuon.bench.setups import Hyper, build


@dataclass
class BenchOptions:
    """What to run; the same for every configuration."""

    model: str = "qwen2"
    """Workload name (see :func:`dmuon.bench.models.build_workload`)."""
    size: str = "small"
    """Workload size preset."""
    seq_len: int | None = None
    """Tokens per sample override."""
    batch_size: int | None = None
    """Samples per rank override."""
    steps: int = 4
    """Timed steps."""
    warmup: int = 1
    """Untimed steps first (autotuning and caches settle here)."""
    hsdp: int = 1
    """Replicas R: run on an R x (N/R) (replicate, shard) mesh when > 1."""
    hyper: Hyper = field(default_factory=Hyper)
    """Optimizer settings."""
    progress: bool = True
    """Rank 0 prints a progress bar on stderr."""


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


def _fsdp_bytes_per_step(model, world_size: int, replicate: int = 1) -> int:
    """Bytes one rank sends plus receives in FSDP2's collectives per step (from shapes).

    Each sharded parameter is all-gathered for forward and again for backward
    (reshard after forward) and its gradient reduce-scattered once within the
    shard group; ring collectives move (S-1)/S of the tensor through every rank
    each way. HSDP adds a ring all-reduce of the gradient shard across the R
    replicas (2 (R-1)/R of the shard each way).
    """
    shard = world_size // replicate
    total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            nbytes = p.numel() * p.element_size()
            total += 3 * 2 * nbytes * (shard - 1) // shard
            total += 2 * 2 * (nbytes // shard) * (replicate - 1) // replicate
    return total


def _progress(config: str, done: int, total: int) -> None:
    width = 24
    filled = width * done // total
    sys.stderr.write(f"\r  {config:<11} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_config(rank: int, world_size: int, config: str, opts: BenchOptions) -> dict:
    """Trains ``opts.model`` with ``config`` for warmup+steps and reports timings (rank 0's view)."""
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    if opts.hsdp > 1:
        mesh = init_device_mesh(device, (opts.hsdp, world_size // opts.hsdp),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (world_size,))
    rss_before = _start_peak_rss()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        workload = build_workload(opts.model, size=opts.size, seq_len=opts.seq_len,
                                  batch_size=opts.batch_size, seed=0)
    optimizer, plan = build(config, workload, mesh, opts.hyper)
    model = workload.model
    fwd_bwd, opt_s, losses, sent, received, inter, ns = [], [], [], [], [], [], []
    total = opts.warmup + opts.steps
    for step in range(total):
        batch = workload.make_batch(step, rank)
        if device == "cuda":
            batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch
        dist.barrier()
        t0 = time.perf_counter()
        loss = workload.loss_fn(model, batch)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        stats = optimizer.last_step_stats() if hasattr(optimizer, "last_step_stats") else {}
        times = torch.tensor([t1 - t0, t2 - t1, stats.get("ns_seconds", 0.0)], dtype=torch.float64, device=device)
        # A step lasts as long as its slowest rank.
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if step >= opts.warmup:
            fwd_bwd.append(times[0].item())
            opt_s.append(times[1].item())
            ns.append(times[2].item())
            sent.append(stats.get("bytes_sent", 0))
            received.append(stats.get("bytes_received", 0))
            inter.append(stats.get("inter_bytes_sent", 0) + stats.get("inter_bytes_received", 0))
        losses.append(mean_loss.item() / world_size)
        if rank == 0 and opts.progress:
            _progress(config, step + 1, total)
    steps = [a + b for a, b in zip(fwd_bwd, opt_s)]
    opt_bytes = (statistics.median(sent) + statistics.median(received)) if sent else 0
    if config == "torch_muon":
        # DTensor gathers each matrix for NS; count it as the gather baseline moves it.
        opt_bytes = sum(2 * p.numel() * p.element_size() * (world_size - 1) // world_size
                        for g in optimizer.opts[0].param_groups for p in g["params"])
    fsdp_bytes = _fsdp_bytes_per_step(model, world_size, opts.hsdp)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _peak_rss() - rss_before
    balance = plan.balance if plan is not None else None
    peak_t = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    return {
        "config": config,
        "step_s": statistics.median(steps),
        "step_s_min": min(steps),
        "step_s_max": max(steps),
        "optimizer_s": statistics.median(opt_s),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "ns_s": statistics.median(ns),
        "bytes_per_step": int(fsdp_bytes + opt_bytes),
        "fsdp_bytes_per_step": int(fsdp_bytes),
        "optimizer_bytes_per_step": int(opt_bytes),
        "peak_mem_bytes": int(peak_t.item()),
        "final_loss": losses[-1],
        "inter_bytes_per_step": int(statistics.median(inter)) if inter else 0,
        "losses": losses,
        "tokens_per_rank": workload.tokens_per_rank,
        "imbalance": plan.imbalance() if plan is not None else None,
        # The balancer's own figures: seconds with --profile, FLOPs with the analytical model.
        "plan_makespan": balance.makespan if balance is not None else None,
        "plan_mean": balance.mean if balance is not None else None,
    }


def run_all(rank: int, world_size: int, configs: list[str], opts: BenchOptions) -> list[dict]:
    """Runs every configuration in this process group, one after another."""
    out = []
    for config in configs:
        result = run_config(rank, world_size, config, opts)
        out.append(result)
        dist.barrier()
    return out
