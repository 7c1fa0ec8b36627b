"""FSDP2's layout APIs, laid out as torchtitan 0.3.0 uses them, trained with DMuon (run inside spawned ranks).

* ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``: every parameter is
  already a DTensor on the full SPMD mesh (``Replicate`` on its data-parallel dims); FSDP2 turns the
  ``shard`` dims into its row split and keeps the parameter on that mesh (torchtitan's DTensor backends).
  Two meshes of one world: the dense parameters on ``(dp_replicate,) fsdp``, the expert stacks on
  ``(dp_replicate,) efsdp, ep`` (``Shard(0)`` on ``ep``).
* ``shard_placement_fn`` returning ``ShardPlacementResult(placement, mesh_info)``: a parameter on a mesh
  of its own inside one ``fully_shard`` group; here the expert stacks on the efsdp mesh inside their
  block's group, the block's dense parameters on the dense mesh (torchtitan's ``apply_fsdp`` with EP).

Each run returns what ``support.moe.train`` does, so the tests compare it with the same one-process
references (``support.moe.reference``, ``support.equivalence.reference``).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from support import moe
from support.equivalence import SKIP
from support.models import OddNet, lm_loss, odd_batch

DENSE_LAYOUTS = {
    # name: (mesh shape, mesh dim names, DataParallelMeshDims.shard, DataParallelMeshDims.replicate)
    "dims-1d": ((4,), ("fsdp",), "fsdp", None),
    # torchtitan's spmd_types backend: FSDP2 flattens two shard dims into one (a mesh of its own).
    "dims-1d-two-dims": ((2, 2), ("dp_shard", "cp"), ("dp_shard", "cp"), None),
    "dims-hsdp": ((2, 2), ("dp_replicate", "fsdp"), "fsdp", "dp_replicate"),
    # The replicate dim after the shard dim: FSDP2 keeps the parameter on the mesh as given.
    "dims-hsdp-replicate-last": ((2, 2), ("fsdp", "dp_replicate"), "fsdp", "dp_replicate"),
}

MOE_LAYOUTS = {
    # name: the support.moe.LAYOUTS entry it takes world, ep, experts, dim1, replicate from
    "dims-ep2-dim1": "ep2-dim1",
    "dims-ep2-dim0": "ep2-dim0",
    "dims-ep2-hsdp": "ep2-native-hsdp",
    "placement-ep2-dim1": "ep2-dim1",
    "placement-ep2-dim0-uneven": "ep2-dim0-uneven",
    "placement-ep2-hsdp": "ep2-native-hsdp",
}

_LOCAL_KINDS = (nn.Linear, nn.Embedding, nn.RMSNorm, nn.Conv1d)


def compute_locally(model: nn.Module) -> None:
    """Lets torch's plain modules compute with parameters that are DTensors on an SPMD mesh.

    Under ``dp_mesh_dims`` FSDP2 all-gathers a parameter back to its DTensor on the full mesh
    (``Replicate`` on the data-parallel dims), and ``nn.Linear`` refuses a DTensor weight beside the
    rank's plain activations. torchtitan computes on such weights through ``to_local()`` (local_map);
    so do these hooks, for the leaf modules only: the parameter's entry is swapped for its local
    tensor during the module's forward (autograd reaches the DTensor through ``to_local``, whose
    backward gives the gradient the parameter's placements, as FSDP2 expects), then put back."""

    def swap(module, _args):
        module._dmuon_test_saved = dict(module._parameters)
        for name, p in module._parameters.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()

    def restore(module, _args, _out):
        module._parameters.update(module.__dict__.pop("_dmuon_test_saved"))

    for module in model.modules():
        if isinstance(module, _LOCAL_KINDS):
            module.register_forward_pre_hook(swap)
            module.register_forward_hook(restore)


_MESHES: dict[tuple, object] = {}
"""This rank process's meshes, each made once and reused by every run of the process (see :func:`mesh`)."""


def mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """The mesh ``shape`` with dim ``names``, unflattened from one world mesh, the same object every time.

    A process that builds equal meshes twice trips FSDP2: ``nn.Parameter(dtensor)`` detaches through
    DTensor's sharding-propagation cache, which hands back the spec of an earlier *equal* mesh, and
    ``fully_shard(..., dp_mesh_dims=...)`` wants the very mesh object it is given (torch 2.13,
    ``_init_sharding_spec_spmd``). One mesh per layout per process, as a training script has, and every
    run's meshes views of one root, as torchtitan's are."""
    world = dist.get_world_size()
    if "root" not in _MESHES:
        _MESHES["root"] = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = _MESHES["root"]._unflatten(0, tuple(shape), tuple(names))
    return _MESHES[key]


def layout_api(module: str, name: str):
    """``module.name``, one of the FSDP2 layout APIs these runs build with, or an error naming the running
    torch. torch 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (dmuon's range) have them all; ``ShardPlacementResult`` and
    the mesh infos live in a private module torch may move."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"torch {torch.__version__} has no {module}.{name} (FSDP2's dp_mesh_dims and per-parameter "
                           f"meshes): {type(e).__name__}: {e}") from e


def _dims(shard, replicate):
    return layout_api("torch.distributed.fsdp", "DataParallelMeshDims")(shard=shard, replicate=replicate)


def _report(model: nn.Module, opt, initial: dict) -> dict:
    """What every run returns: parameters before and after, the plan's owners, NS counts, momentum sizes."""
    opt.flush_updates()
    stats = opt.last_step_stats()
    named = dict(model.named_parameters())
    placements = {n: (str(p.device_mesh.mesh_dim_names), str(p.placements)) for n, p in named.items()
                  if isinstance(p, DTensor)}
    return {"initial": initial, "params": moe.full_state(model),
            "owners": {i.name: i.owner for i in opt.plan.infos}, "orthogonalized": stats["orthogonalized"],
            "momentum_numel": {n: opt.state[p]["momentum_buffer"].to_local().numel()
                               for n, p in named.items() if "momentum_buffer" in opt.state.get(p, {})},
            "placements": placements, "loads": list(opt.plan.balance_result.loads)}


def dense(rank: int, world: int, layout: str, steps: int = 3) -> dict:
    """OddNet (seed 0) as a ``distribute_module`` model on the full mesh of ``DENSE_LAYOUTS[layout]``,
    each block and the root ``fully_shard``-ed with ``dp_mesh_dims``, trained with DMuon (fp32 NS),
    every rank reading its own batch, block 1 unused at step 1 (support.equivalence's run)."""
    import dmuon
    from torch.distributed.fsdp import fully_shard

    shape, names, shard, replicate = DENSE_LAYOUTS[layout]
    full = mesh(shape, names)
    torch.manual_seed(0)
    model = OddNet()
    distribute_module(model, full)  # every parameter Replicate on every mesh dim
    dims = _dims(shard, replicate)
    for layer in model.layers:
        fully_shard(layer, mesh=full, dp_mesh_dims=dims)
    fully_shard(model, mesh=full, dp_mesh_dims=dims)
    compute_locally(model)
    initial = moe.full_state(model)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                      ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    for step in range(steps):
        model.skip = SKIP.get(step, set())
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return _report(model, opt, initial)


def _meshes(world: int, ep: int, replicate: int):
    """The world mesh unflattened twice (support.moe.expert_parallel's meshes): ``(dense, experts)``."""
    data = world // replicate
    if replicate > 1:
        return (mesh((replicate, data), ("dp_replicate", "fsdp")),
                mesh((replicate, data // ep, ep), ("dp_replicate", "efsdp", "ep")))
    return mesh((data,), ("fsdp",)), mesh((data // ep, ep), ("efsdp", "ep"))


def _on_mesh(module: nn.Module, name: str, mesh, placements) -> None:
    setattr(module, name, nn.Parameter(distribute_tensor(getattr(module, name).data, mesh, placements)))


def _divide_by_world(module, world: int, efsdp: int, replicate: int) -> None:
    """The experts' gradient divided by every data rank, as support.moe.expert_parallel does (a sum then a
    division on gloo, which refuses PREMUL_SUM)."""
    module.set_gradient_divide_factor(float(world))
    if efsdp * replicate > 1:
        module.set_force_sum_reduction_for_comms(True)


def _shard_with_dims(model: moe.MoENet, world: int, ep: int, replicate: int, dim1: bool) -> None:
    """``dp_mesh_dims``: every parameter a DTensor on its full mesh first (dense: ``Replicate`` on
    ``(dp_replicate,) fsdp``; stacks: ``Replicate`` on ``(dp_replicate,) efsdp``, ``Shard(0)`` on ``ep``),
    the experts ``fully_shard``-ed over ``efsdp``, each block and the root over ``fsdp``."""
    from torch.distributed.fsdp import fully_shard

    dense_mesh, expert_mesh = _meshes(world, ep, replicate)
    rep = "dp_replicate" if replicate > 1 else None
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if isinstance(module, moe.RoutedExperts):
                _on_mesh(module, name, expert_mesh, [Replicate()] * (expert_mesh.ndim - 1) + [Shard(0)])
            else:
                _on_mesh(module, name, dense_mesh, [Replicate()] * dense_mesh.ndim)
    efsdp = expert_mesh["efsdp"].size()
    for block in model.layers:
        fully_shard(block.experts, mesh=expert_mesh, dp_mesh_dims=_dims("efsdp", rep),
                    shard_placement_fn=(lambda p: Shard(1)) if dim1 else None)
        _divide_by_world(block.experts, world, efsdp, replicate)
        fully_shard(block, mesh=dense_mesh, dp_mesh_dims=_dims("fsdp", rep))
    fully_shard(model, mesh=dense_mesh, dp_mesh_dims=_dims("fsdp", rep))
    compute_locally(model)


def _shard_with_placements(model: moe.MoENet, world: int, ep: int, replicate: int, dim1: bool) -> None:
    """``ShardPlacementResult``: the stacks split over ``ep`` (``Shard(0)``), then each block
    ``fully_shard``-ed over the dense mesh with a ``shard_placement_fn`` putting its stacks on the efsdp mesh
    (``(dp_replicate,) efsdp``: FSDPMeshInfo, HSDPMeshInfo) inside the block's group."""
    from torch.distributed.fsdp import fully_shard

    common = "torch.distributed.fsdp._fully_shard._fsdp_common"
    FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult = (layout_api(common, n) for n in
                                                        ("FSDPMeshInfo", "HSDPMeshInfo", "ShardPlacementResult"))

    dense_mesh, expert_mesh = _meshes(world, ep, replicate)
    if replicate > 1:
        edp = expert_mesh["dp_replicate", "efsdp"]
    else:
        edp = expert_mesh["efsdp"]
    for block in model.layers:
        routed = block.experts
        for name in ("w1", "w2"):
            _on_mesh(routed, name, expert_mesh["ep"], [Shard(0)])
        # One mesh info per group: FSDP2 groups a block's parameters by their process groups and wants the
        # same FSDPMeshInfo object for every parameter of one group.
        info = (HSDPMeshInfo(edp, shard_mesh_dim=1, replicate_mesh_dim=0) if replicate > 1
                else FSDPMeshInfo(edp, shard_mesh_dim=0))
        stacks = {id(routed.w1), id(routed.w2)}

        def place(p, stacks=stacks, info=info):
            if id(p) in stacks:
                return ShardPlacementResult(placement=Shard(1) if dim1 else Shard(0), mesh_info=info)
            return None  # the block's own mesh, Shard(0)

        fully_shard(block, mesh=dense_mesh, shard_placement_fn=place)
        # Both of the block's groups (dense over fsdp, the stacks over efsdp) divided by every data rank, as
        # a sum then a division: with 4 ranks neither group's reduce-scatter spans them all, and gloo
        # refuses the PREMUL_SUM FSDP2 would use.
        block.set_gradient_divide_factor(float(world))
        block.set_force_sum_reduction_for_comms(True)
    fully_shard(model, mesh=dense_mesh)


def experts(rank: int, world: int, layout: str, steps: int = 3, apply_updates: str = "in_step") -> dict:
    """support.moe's MoENet laid out by ``MOE_LAYOUTS[layout]`` (``dims-*``: dp_mesh_dims on full-mesh
    DTensors; ``placement-*``: ShardPlacementResult), trained with DMuon (fp32 NS) for ``steps`` steps
    (``apply_updates``: ExecutionConfig's; ``"next_forward"`` asks whether a unit's parameters are
    gathered, of every FSDP group of the unit)."""
    import dmuon

    size, ep, count, dim1, replicate, *_ = moe.LAYOUTS[MOE_LAYOUTS[layout]]
    assert size == world, (layout, world)
    if dim1 is None:
        dim1 = (world // replicate) > count
    torch.manual_seed(0)
    model = moe.MoENet(count)
    shard = _shard_with_dims if layout.startswith("dims-") else _shard_with_placements
    shard(model, world, ep, replicate, dim1)
    initial = moe.full_state(model)
    opt = dmuon.DMuon(model, lr=moe.MUON["lr"], weight_decay=moe.MUON["weight_decay"],
                      ns=dmuon.NSConfig(method="standard", dtype=torch.float32), adamw=dict(moe.ADAMW),
                      execution=dmuon.ExecutionConfig(apply_updates=apply_updates))
    for step in range(steps):
        moe.loss_of(model, moe.batch(step, dist.get_rank(), world)).backward()
        opt.step()
        opt.zero_grad()
    out = _report(model, opt, initial)
    # Whether the stacks are a fully_shard unit of their own (dp_mesh_dims) or in their block's (placement).
    from torch.distributed.fsdp import FSDPModule

    out["experts_own_unit"] = [isinstance(block.experts, FSDPModule) for block in model.layers]
    return out
