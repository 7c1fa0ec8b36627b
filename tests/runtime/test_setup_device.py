"""Setup on the parameters' device, and dmuon's groups warmed up at setup."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

import dmuon

build = importlib.import_module("dmuon.prepare.build")  # where prepare() looks its steps up
mesh = importlib.import_module("dmuon.prepare.mesh")
from support.spawn import run_distributed


class _MeshOn:
    """A mesh that reports another device type (``"cuda"``), everything else the real mesh's."""

    def __init__(self, mesh, device_type: str) -> None:
        self._mesh = mesh
        self.device_type = device_type

    def __getattr__(self, name):
        return getattr(self._mesh, name)


def _plan_device_with_another_current_device(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layout_of = build.layout_of
    consulted = []

    def current_device() -> int:
        consulted.append(True)
        return 1  # a script that calls prepare before set_device: the current device is another one

    # As on a CUDA machine whose current device is not this rank's: the mesh says "cuda", the
    # parameters live where they are (the CPU here).
    build.layout_of = lambda *a, **k: (_MeshOn(layout_of(*a, **k)[0], "cuda"), layout_of(*a, **k)[1])
    saved = torch.cuda.current_device
    torch.cuda.current_device = current_device
    try:
        plan = dmuon.prepare(model, ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    finally:
        torch.cuda.current_device = saved
        build.layout_of = layout_of
    return {"device": str(plan.device), "consulted": bool(consulted)}


def test_plan_device_is_the_parameters_device_not_the_current_one():
    results = run_distributed(_plan_device_with_another_current_device, 2, timeout_s=60)
    assert results == [{"device": "cpu", "consulted": False}] * 2


def test_parameters_on_several_devices_are_named():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4, device="meta"))
    chosen = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    device, mixed = mesh.parameter_device(model, chosen, None)
    assert device == torch.device("cpu")
    assert "'0.weight' on cpu" in mixed and "'1.weight' on meta" in mixed
    assert mesh.parameter_device(model, chosen[:1], None) == (torch.device("cpu"), None)


def _warmed_groups(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from support.cases import make_mesh

    out = {}
    for name, mesh_shape in (("1-D", None), ("2x2", (2, 2))):
        mesh = make_mesh(world_size, mesh_shape)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        plan = dmuon.prepare(model, ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
        topo = plan.topology
        ours = [topo.mesh_group] + [g for g in (topo.shard_group, topo.replicate_group)
                                    if g is not None and g is not topo.mesh_group]
        seen = []
        originals = {op: getattr(dist, op) for op in ("all_to_all_single", "all_reduce")}

        def recording(op):
            def call(*args, group=None, **kwargs):
                if any(group is g for g in ours):
                    seen.append((op, ours.index(group)))
                return originals[op](*args, group=group, **kwargs)
            return call

        for op in originals:
            setattr(dist, op, recording(op))
        try:
            dmuon.DMuon(model, plan, lr=0.02)
        finally:
            for op, original in originals.items():
                setattr(dist, op, original)
        out[name] = seen
    return out


def test_each_group_is_warmed_at_setup():
    """Each of dmuon's groups this rank belongs to gets one warm-up collective when the runtime starts, in
    creation order, before any backward: an all-to-all on the exchange groups, and on HSDP's mesh group, which
    carries no all-to-all, a one-element all-reduce (no all-pairs connections there)."""
    results = run_distributed(_warmed_groups, 4, timeout_s=60)
    assert results == [{"1-D": [("all_to_all_single", 0)],
                        "2x2": [("all_reduce", 0), ("all_to_all_single", 1), ("all_to_all_single", 2)]}] * 4
