"""Misuse and failure cases run inside spawned ranks: each must raise a clear error, never hang."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import dmuon

from support.cases import full_params, sharded_oddnet, shard_oddnet
from support.models import OddNet, lm_loss, odd_batch


def _catch(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def mismatched_models(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet(blocks=3 if rank == 0 else 2)
    shard_oddnet(model, mesh)
    return _catch(lambda: dmuon.DMuon(model))


def root_not_sharded(rank: int, world_size: int) -> str:
    """Only the blocks are fully_shard-ed: the root's matrices (conv, gate, lift) are plain tensors."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return _catch(lambda: dmuon.DMuon(model))


def kernel_sharded(rank: int, world_size: int) -> str:
    """A shard_placement_fn that shards the conv kernel's dim 2 (the kernel width): a layout
    dmuon does not support (a matrix's dims after the first two must be whole)."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet()

    def placement(p):
        return Shard(2) if p.ndim == 3 else None

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return _catch(lambda: dmuon.DMuon(model))


def plan_for_another_model(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    model, other = OddNet(), OddNet()
    shard_oddnet(model, mesh)
    shard_oddnet(other, mesh)
    plan = dmuon.prepare(other)
    return _catch(lambda: dmuon.DMuon(model, plan))


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 6, sparse=True)
        self.proj = nn.Linear(6, 3, bias=False)

    def forward(self, idx):
        return self.proj(self.table(idx)).sum()


def sparse_gradient() -> str:
    """One process: a matrix chosen by ``select`` gets a sparse gradient."""
    model = SparseNet()
    opt = dmuon.DMuon(model, dmuon.prepare(model, select=lambda n, p: p.ndim == 2))

    def backward_and_step():
        model(torch.tensor([1, 2, 3])).backward()
        opt.step()

    return _catch(backward_and_step)


def traffic(rank: int, world_size: int, mesh_shape, ns_dtype: torch.dtype) -> dict:
    """Counted bytes of one steady-state step, to compare with the analytical model."""
    model, plan, opt = sharded_oddnet(world_size, mesh_shape=mesh_shape, ns_dtype=ns_dtype)
    for step in range(2):
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return {
        "stats": opt.last_step_stats(),
        "shapes": [i.shape for i in plan.infos],
        "owners": [i.owner for i in plan.infos],
    }


def nonfinite(rank: int, world_size: int, mode: str, **execution) -> dict:
    """Rank 1 gets a NaN in one matrix's gradient at step 1; report what every rank did (``execution``:
    more :class:`dmuon.ExecutionConfig` switches)."""
    model, plan, opt = sharded_oddnet(world_size, execution=dmuon.ExecutionConfig(nonfinite=mode, **execution))
    outcome = []
    for step in range(2):
        handle = None
        if step == 1 and rank == 1:
            def poison(g):
                g = g.clone()
                g.view(-1)[0] = float("nan")
                return g

            # A hook on the unsharded parameter: the NaN goes into FSDP2's reduce-scatter.
            handle = model.layers[1].mid.register_full_backward_pre_hook(
                lambda module, grad_output: tuple(poison(g) for g in grad_output))
        lm_loss(model, odd_batch(step, rank)).backward()
        if handle is not None:
            handle.remove()
        before = full_params(model)
        try:
            opt.step()
            stats = opt.last_step_stats()
            after = full_params(model)
            changed = any(not torch.equal(before[n], after[n]) for n in before)
            outcome.append(("skipped" if stats["skipped_nonfinite"] else "stepped", changed))
        except FloatingPointError as e:
            outcome.append(("raised", str(e)))
        opt.zero_grad()
    return {"outcome": outcome}


def milp_owners(rank: int, world_size: int) -> list[int]:
    """Owners ``prepare(balancer="milp")`` picks on this rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet()
    shard_oddnet(model, mesh)
    return [i.owner for i in dmuon.prepare(model, balancer="milp").infos]


def fsdp_blocks(rank: int, world_size: int) -> dict:
    """Which FSDP2 module each matrix's gradient comes from, and its row split."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet()
    shard_oddnet(model, mesh)
    plan = dmuon.prepare(model)
    return {"blocks": [b.name for b in plan.blocks],
            "block_of": {i.name: i.block for i in plan.infos},
            "rows": {i.name: i.rows for i in plan.infos}}


def rank_crashes(rank: int, world_size: int, where: str, zero: int) -> dict:
    """Rank 1 raises in step 1, inside backward or inside ``step()``; the others carry on.

    Returns (on ranks that do not crash) how long the rank kept going until dmuon's
    or FSDP2's next collective failed, and with what.
    """
    model, plan, opt = sharded_oddnet(world_size, zero=zero)
    start = None
    try:
        for step in range(3):
            if step == 1:
                start = time.perf_counter()
                if rank == 1 and where == "step":
                    def broken_apply(*args, **kwargs):
                        raise RuntimeError("injected failure inside step()")

                    # Once the agreement is in, where the old _muon_step was: applying the updates.
                    opt.runtime.callbacks.apply = broken_apply
                if rank == 1 and where == "backward":
                    def broken_hook(module, grad_output):
                        raise RuntimeError("injected failure inside backward")

                    model.layers[1].mid.register_full_backward_pre_hook(broken_hook)
            lm_loss(model, odd_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - the point is to report it
        if rank == 1:
            raise
        return {"failed_after_s": time.perf_counter() - start, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"finished": True}


def _worker_stack(thread) -> list[str]:
    """The functions on ``thread``'s Python stack, innermost first."""
    import sys

    frame, names = sys._current_frames().get(thread.ident), []
    while frame is not None:
        names.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        frame = frame.f_back
    return names


def raise_mid_backward_with_the_worker_waiting(rank: int, world_size: int) -> None:
    """HSDP (dmuon's replicate level), NS in backward: rank 1 raises inside backward's second block,
    once the NS worker waits for a hop of the first block's exchange that the main thread would
    issue next; it prints ``worker waiting in [...] at <time.time()>`` first. The exception leaves the
    function: run by a process's top level, the interpreter's own exit follows (no ``os._exit``)."""
    import sys
    import threading

    model, plan, opt = sharded_oddnet(world_size, mesh_shape=(world_size, 1), hsdp="dmuon",
                                      execution=dmuon.ExecutionConfig(ns_in_backward=True))
    for step in range(2):
        if step == 1 and rank == 1:
            def broken_hook(module, grad_output):
                worker = next(t for t in threading.enumerate() if t.name.startswith("dmuon-ns"))
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and "pending.py:wait" not in _worker_stack(worker):
                    time.sleep(0.01)
                print(f"worker waiting in {_worker_stack(worker)[:3]} at {time.time()}", file=sys.stderr, flush=True)
                raise RuntimeError("injected failure inside backward")

            model.layers[0].mid.register_full_backward_pre_hook(broken_hook)
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
