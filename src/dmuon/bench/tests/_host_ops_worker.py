"""Worker of test_host_ops: one optimizer step of a bench configuration, its operations counted."""

from __future__ import annotations

import torch


def count_step(rank: int, world_size: int, config: str, size: str = "tiny") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon.baselines.gather as gather
    import dmuon.optim.callbacks as callbacks
    from dmuon.bench.models import build_workload
    from dmuon.bench.op_count import OpCounter
    from dmuon.bench.setups import Hyper, build

    torch.manual_seed(0)
    workload = build_workload("qwen2", size=size, seed=0)
    opt, _ = build(config, workload, init_device_mesh("cpu", (world_size,)), Hyper())
    counter = OpCounter()
    # The owners' NS is priced apart (its profile or FLOPs): not counted.
    gather.owner_update = counter.wrap_paused(gather.owner_update)
    callbacks.owner_update = counter.wrap_paused(callbacks.owner_update)
    for step in range(3):  # the last step counted: state exists, launches settled
        workload.loss_fn(workload.model, workload.make_batch(step, rank)).backward()
        if step == 2:
            with counter:
                opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return {"counts": dict(counter.counts), "tensors": len(list(workload.model.parameters()))}
