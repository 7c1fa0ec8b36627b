"""The NS autotuner measures at setup, never inside a step: a cold cache cannot deadlock the ranks.

On CUDA a measurement waits for the device (``torch.cuda.synchronize`` in the old timing, Triton's
``do_bench`` still does), and a device wait also waits for every collective the rank has in flight;
on CPU with gloo it is a no-op. The runs below give :func:`dmuon.ortho.timing.sync` CUDA's meaning:
it waits for every ``all_to_all_single``/``all_reduce`` this rank issued asynchronously and has
not seen finish.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from support.spawn import run_distributed, run_with_crashes

# Four matrices of four shapes; with the round-robin balancer on two ranks each owns two shapes,
# so each owner runs two NS batches, one per return wave (return_waves=2).
DIMS = (16, 24, 20, 28, 16)
STEPS = 2


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIMS[k], DIMS[k + 1], bias=False), nn.Linear(DIMS[k + 1], DIMS[k + 2], bias=False))
            for k in (0, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _sharded_chain(world_size: int) -> "_Chain":
    """The model, seeded, fully_shard-ed block by block over a 1-D mesh of every rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = _Chain()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _InFlight:
    """Records every asynchronous all-to-all and all-reduce this rank issues; :meth:`sync` waits
    for them all, as a CUDA device synchronize waits for the NCCL kernels on the device."""

    def __init__(self) -> None:
        self.works: list = []
        self.syncs = 0
        self._originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce")}
        for name, original in self._originals.items():
            setattr(dist, name, self._recording(original))

    def _recording(self, original):
        def call(*args, **kwargs):
            work = original(*args, **kwargs)
            if kwargs.get("async_op"):
                self.works.append(work)
            return work

        return call

    def sync(self, device) -> None:
        self.syncs += 1
        works, self.works = self.works, []
        for work in works:
            work.wait()

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _cold_cache_run(rank: int, world_size: int, cache_dir: str, delay_s: float) -> dict:
    from dmuon.ortho import autotune, timing

    os.environ["DMUON_CACHE_DIR"] = cache_dir
    timing.COOLDOWN_S = 0.0  # the pause matters for real verdicts, not for this run's order of events
    inflight = _InFlight()
    timing.sync = inflight.sync
    try:
        model = _sharded_chain(world_size)
        plan = dmuon.prepare(model, balancer="round_robin", ns=dmuon.NSConfig(method="auto", dtype=torch.float32))
        owned = sorted({info.matrix_shape for info in plan.infos if info.owner == rank})
        opt = dmuon.DMuon(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                          execution=dmuon.ExecutionConfig(overlap=False, return_waves=2))
        tuner = autotune.get_autotuner()
        at_setup = tuner.measurements
        runtime = opt.runtime
        callbacks = runtime.callbacks
        owner_work = callbacks.owner_work
        first = [True]

        def late_owner_work(*args, **kwargs):
            # Rank 1 reaches its first NS batch of the step late: rank 0 has by then returned
            # its first wave and asks the tuner for its second batch.
            if rank == 1 and first[0]:
                first[0] = False
                time.sleep(delay_s)
            return owner_work(*args, **kwargs)

        callbacks.owner_work = late_owner_work
        waves = []
        for step in range(STEPS):
            x = torch.randn(4, DIMS[0], generator=torch.Generator().manual_seed(step * world_size + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            waves.append(opt.last_step_report().return_waves)
        return {"owned": owned, "at_setup": at_setup, "in_steps": tuner.measurements - at_setup, "waves": waves,
                "syncs": inflight.syncs}
    finally:
        inflight.restore()


def test_cold_cache_tuning_with_two_return_waves_does_not_hang(tmp_path):
    # Measuring inside the step hangs: rank 0 holds the host's tuning lock and waits (the device
    # sync) for its first wave's return, which rank 1 issues only after it got the lock. A rank
    # still running at the deadline is killed and reported as hung.
    results = run_with_crashes(_cold_cache_run, 2, str(tmp_path / "cache"), 3.0, timeout_s=60, deadline_s=90)
    for rank, r in enumerate(results):
        assert "hung" not in r and "raised" not in r, f"rank {rank}: {r}"
        assert len(r["owned"]) == 2, f"rank {rank} owns {r['owned']}: the run needs two shapes per owner"
        assert all(len(w) == 2 for w in r["waves"]), r["waves"]
        assert r["syncs"] > 0  # the measurements did wait on the device
        assert r["at_setup"] > 0 and r["in_steps"] == 0, r


def _steps_never_time(rank: int, world_size: int, cache_dir: str) -> dict:
    from dmuon.ortho import autotune

    os.environ["DMUON_CACHE_DIR"] = cache_dir
    autotune.get_autotuner().cooldown_s = 0.0
    model = _sharded_chain(world_size)
    # Built before prepare (the deferred setup, at the first forward); NS in backward's worker and the
    # returns in backward: every place the owners' work runs.
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), ns=dmuon.NSConfig(method="auto", dtype=torch.bfloat16),
                      execution=dmuon.ExecutionConfig(ns_in_backward=True, returns_in_backward=True,
                                                      return_waves=2))
    timed = []

    def refuse(fns, *args, **kwargs):
        timed.append(sorted(fns))
        raise AssertionError("the tuner timed candidates inside a step")

    original = autotune.time_candidates
    tuner = autotune.get_autotuner()
    reports = []
    for step in range(STEPS):
        x = torch.randn(4, DIMS[0], generator=torch.Generator().manual_seed(step * world_size + rank))
        loss = model(x).square().mean()  # the first forward sets the optimizer up, and tunes
        if step == 0:
            at_setup = tuner.measurements
            autotune.time_candidates = refuse
        loss.backward()
        opt.step()
        opt.zero_grad()
        reports.append(opt.last_step_stats())
    autotune.time_candidates = original
    return {"at_setup": at_setup, "in_steps": tuner.measurements - at_setup, "timed": timed,
            "misses": tuner.frozen_misses, "in_backward": [r["orthogonalized_in_backward"] for r in reports]}


def test_no_measurement_inside_backward_or_step(tmp_path):
    results = run_distributed(_steps_never_time, 2, str(tmp_path / "cache"), timeout_s=60)
    for r in results:
        assert r["at_setup"] > 0 and r["in_steps"] == 0 and r["timed"] == [], r
        assert r["misses"] == 0, r  # the setup asked for every problem the steps ran
    assert sum(sum(r["in_backward"]) for r in results) > 0  # the worker did run NS
