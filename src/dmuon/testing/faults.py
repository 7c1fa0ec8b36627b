"""Misuse cases run inside spawned ranks: each must raise a clear error, never hang."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing.cases import sharded_oddnet
from dmuon.testing.models import OddNet, lm_loss, odd_batch


def _catch(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def mismatched_models(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet(blocks=3 if rank == 0 else 2)
    return _catch(lambda: dmuon.prepare(model, mesh))


def prepare_after_fully_shard(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    model = OddNet()
    fully_shard(model, mesh=mesh)
    return _catch(lambda: dmuon.prepare(model, mesh))


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 6, sparse=True)
        self.proj = nn.Linear(6, 3, bias=False)

    def forward(self, idx):
        return self.proj(self.table(idx)).sum()


def sparse_gradient(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    model = SparseNet()
    plan = dmuon.prepare(model, mesh, zero=2, select=lambda n, p: p.ndim == 2)
    opt = dmuon.DMuon(model, plan)

    def backward_and_step():
        model(torch.tensor([1, 2, 3])).backward()
        opt.step()

    return _catch(backward_and_step)


def traffic(rank: int, world_size: int, zero: int) -> dict:
    """Counted bytes of one steady-state step, to compare with the analytical model."""
    model, plan, opt = sharded_oddnet(world_size, zero=zero)
    for step in range(2):
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return {
        "stats": opt.last_step_stats(),
        "numels": [i.numel for i in plan.infos],
        "owners": [i.owner for i in plan.infos],
        "blocks": [i.block for i in plan.infos],
        "kept_block": plan.runtime.resident_through_backward,
        "elem": plan.infos[0].param.element_size(),
    }


class Branches(torch.nn.Module):
    """Three bias-free branches summed; ``order`` sets the order they run in."""

    def __init__(self, dim: int = 23):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.order = [0, 1, 2]

    def forward(self, x):
        return sum(self.layers[k](x) for k in self.order).square().mean()


def rotated_branches(rank: int, world_size: int, overlap: bool) -> dict:
    """Each rank runs the branches in its own order, so gradients land in different orders."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = Branches()
    model.order = [(k + rank) % 3 for k in range(3)]
    plan = dmuon.prepare(model, mesh, zero=2)
    opt = dmuon.DMuon(model, plan, overlap=overlap, ns_method="standard", ns_dtype=torch.float32)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(4, 23, generator=g)).backward()
        opt.step()
        opt.zero_grad()
    from dmuon.fsdp.runtime import full_matrices

    return full_matrices(plan.runtime)


def nonfinite(rank: int, world_size: int, mode: str) -> dict:
    """Rank 1 gets a NaN gradient in one matrix at step 1; report what every rank did."""
    model, plan, opt = sharded_oddnet(world_size, zero=2, nonfinite=mode)
    outcome = []
    for step in range(2):
        handle = None
        if step == 1 and rank == 1:
            # Poison the gradient as it is produced, before overlap sends it anywhere.
            def poison(g):
                g = g.clone()
                g[0, 0] = float("nan")
                return g

            handle = model.layers[1].mid.weight.register_hook(poison)
        lm_loss(model, odd_batch(step, rank)).backward()
        if handle is not None:
            handle.remove()
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p in plan.matrices}
        try:
            opt.step()
            stats = opt.last_step_stats()
            changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
            outcome.append(("skipped" if stats["skipped_nonfinite"] else "stepped", changed))
        except FloatingPointError as e:
            outcome.append(("raised", str(e)))
        opt.zero_grad()
    return {"outcome": outcome}


def milp_owners(rank: int, world_size: int) -> list[int]:
    """Owners ``prepare(balancer="milp")`` picks on this rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    plan = dmuon.prepare(OddNet(), mesh, balancer="milp", zero=2)
    return [i.owner for i in plan.infos]


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
                    def broken_step(*args, **kwargs):
                        raise RuntimeError("injected failure inside step()")

                    opt._muon_step = broken_step
                if rank == 1 and where == "backward":
                    def broken_hook(grad):
                        raise RuntimeError("injected failure inside backward")

                    model.layers[1].mid.weight.register_hook(broken_hook)
            lm_loss(model, odd_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - the point is to report it
        if rank == 1:
            raise
        return {"failed_after_s": time.perf_counter() - start, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"finished": True}
