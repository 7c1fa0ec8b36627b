"""Worker for the FSDP2 test: shards a workload on gloo and runs a reference.

A separate module so that spawned processes (where ``fork`` is unavailable)
can import it without ``conftest.py``.
"""

from __future__ import annotations

import os
import socket

import _bench_import

_bench_import.ensure_importable()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dmuon.bench.models import build_workload  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, names: tuple[str, ...], steps: int,
                 queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        result = {}
        for name in names:
            w = build_workload(name, size="tiny")
            ref = build_workload(name, size="tiny")
            for block in w.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(w.model, mesh=mesh)
            opt = torch.optim.SGD(w.model.parameters(), lr=0.2)
            ref_opt = torch.optim.SGD(ref.model.parameters(), lr=0.2)
            losses = []
            for step in range(steps):
                loss = w.loss_fn(w.model, w.make_batch(step, rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                ref_loss = ref.loss_fn(ref.model, ref.global_batch(step, world))
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                losses.append((mean.item() / world, ref_loss.item()))
            ref_params = dict(ref.model.named_parameters())
            diff = max((p.full_tensor() - ref_params[n]).abs().max().item()
                       for n, p in w.model.named_parameters())
            result[name] = (losses, diff)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()




def run(world: int, names: tuple[str, ...], steps: int) -> dict:
    """Runs ``steps`` sharded SGD steps per workload on ``world`` gloo ranks.

    Returns:
        ``{name: (losses, max_param_diff)}`` where ``losses`` is a list of
        ``(mean sharded loss, single-process global-batch loss)`` per step and
        ``max_param_diff`` the largest absolute difference between the
        gathered sharded parameters and the reference ones afterwards.
    """
    # Forking reuses the parent's imports (transformers takes seconds to import).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    queue = mp.get_context(method).SimpleQueue()
    mp.start_processes(_fsdp_worker, args=(world, _free_port(), names, steps, queue),
                       nprocs=world, start_method=method, join=True)
    return queue.get()
