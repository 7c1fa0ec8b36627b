"""Worker for the runner test: each bench configuration built and stepped on gloo ranks."""

from __future__ import annotations

import time

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon.bench.runner import BenchOptions, _ConfigRun
from support.spawn import run_distributed


def _worker(rank: int, world: int, configs: tuple[str, ...], steps: int, late_s: float) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    opts = BenchOptions(model="tiny", size="tiny", steps=steps, progress=False)
    out = {}
    for config in configs:
        run = _ConfigRun(rank, world, config, opts, mesh, "cpu")
        if late_s and rank == world - 1:
            between = run._between_backward_and_step

            def late(timed, between=between):
                between(timed)
                time.sleep(late_s)  # between backward and step(): outside the timed phases

            run._between_backward_and_step = late
        model = run.workload.model
        all_dtensors = all(isinstance(p, DTensor) for p in model.parameters())
        # What FSDP2 holds for the first block once forward has moved past it:
        # its sharded DTensors again (resharded after forward) or the gathered weights.
        seen = []
        first, second = run.workload.blocks[0], run.workload.blocks[1]
        hook = second.register_forward_pre_hook(
            lambda m, args: seen.append(all(isinstance(p, DTensor) for p in first.parameters())))
        # And what it holds for the root's own parameters when backward begins (the loss computed).
        # (by name: FSDP2 swaps the tensors a module holds, gathered or sharded).
        in_blocks = {id(p) for block in run.workload.blocks for p in block.parameters()}
        root_own = [n for n, p in model.named_parameters() if id(p) not in in_blocks]
        root_numel = sum(model.get_parameter(n).numel() for n in root_own)
        loss_fn, root_seen = run.workload.loss_fn, []

        def loss_then_look(m, batch, loss_fn=loss_fn):
            loss = loss_fn(m, batch)
            root_seen.append(any(isinstance(m.get_parameter(n), DTensor) for n in root_own))
            return loss

        run.workload.loss_fn = loss_then_look
        measured, timing = {True: 0, False: 0}, [False]
        measure = run._measure_live

        def counted(point, measure=measure):
            measured[timing[0]] += 1
            measure(point)

        run._measure_live = counted
        # One untimed step first, as the bench's warmup: it measures the live memory.
        for step in range(1 + steps):
            timing[0] = step > 0
            run.train_step(timed=step > 0)
            if step == 0:
                hook.remove()
        result = run.result()
        result["all_dtensors"] = all_dtensors
        result["sharded_after_forward"] = seen[0]
        result["root_sharded_after_forward"] = root_seen[0]
        result["root_numel"] = root_numel
        result["live_measurements"] = dict(measured)
        out[config] = result
        del run
        dist.barrier()
    return out


def run(world: int, configs: tuple[str, ...], steps: int, late_s: float = 0.0) -> dict:
    """Runs one untimed and ``steps`` timed bench training steps of each configuration (model "tiny") on ``world`` ranks.

    Returns:
        Rank 0's ``{config: result}``: the runner's result dict plus
        ``all_dtensors`` (every parameter sharded by FSDP2 after ``build``) and
        ``sharded_after_forward`` (the first block's parameters were sharded
        DTensors again when the second block's forward began), ``root_sharded_after_forward`` (some
        parameter of the root's own, in no block, was a sharded DTensor when backward began),
        ``root_numel`` (their elements) and
        ``live_measurements`` (``{timed: calls}`` of the live-memory measurement). With ``late_s``
        the last rank sleeps that long after each backward, before ``step()``.
    """
    return run_distributed(_worker, world, configs, steps, late_s)[0]
