"""What every section of the GPU check shares: the bench's configurations and a one-rank process group."""

from __future__ import annotations

import contextlib
import os

import torch


def bench_configs(device: torch.device) -> list[str]:
    """The bench's default set, dmuon with ``overlap=False`` (``dmuon_z3_sync``), and on an accelerator
    dmuon with ``post_optim_event=True`` (CPU has no events)."""
    from dmuon.bench.setups import CONFIGS

    return list(CONFIGS) + ["dmuon_z3_sync"] + (["dmuon_z3_event"] if device.type == "cuda" else [])


@contextlib.contextmanager
def one_rank(device: torch.device):
    """A one-rank process group in this process (NCCL on CUDA, else gloo); yields the backend."""
    import torch.distributed as dist

    from dmuon.testing import install_checker_from_env
    from dmuon.testing.spawn import free_port

    backend = "nccl" if device.type == "cuda" else "gloo"
    # The launcher's variables, as a torchrun rank has them; restored after, so that what runs next in this
    # process (a test of `dmuon bench`, which reads them to tell a torchrun rank) does not see a rank 0 of 1.
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    install_checker_from_env()  # the CPU run's streams under the checker where $DMUON_CHECK_STREAMS is 1
    try:
        yield backend
    finally:
        dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
