"""What ``prepare`` reads of the model as a whole: its mesh and HSDP kind, its device, its
``fully_shard`` blocks, and that every rank has the same model."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon.comm.setup_collectives import gather_rows
from dmuon.comm.topology import Topology
from dmuon.ortho.config import NSConfig
from dmuon.plan.layout import hsdp_meshes, replicated_mesh
from dmuon.util.torch_compat import has_all_reduce_hook, root_mesh, strided_shard_type

# FSDP2 marks its row split inside a tensor-parallel one with _StridedShard; the momentum's
# column split inside TP's is the same kind of layout.
_StridedShard = strided_shard_type()


def fingerprint(model: nn.Module, chosen: list[str], balancer: str, ns: NSConfig) -> torch.Tensor:
    h = hashlib.sha256(f"{balancer}|{sorted(ns.cache_key().items())}|{','.join(chosen)}".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(torch.int64)


def check_same_everywhere(fingerprint: torch.Tensor, topology: Topology, device) -> None:
    world_size = topology.world_size
    rows = gather_rows(fingerprint.to(device), topology.mesh_group, world_size).cpu()
    differing = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differing:
        raise ValueError(
            "dmuon.prepare: ranks disagree on the model's parameters (names, shapes, dtypes, "
            f"requires_grad, order) or on prepare's arguments; ranks {differing} differ from rank 0"
        )


def parameter_device(model: nn.Module, chosen: list[tuple[str, nn.Parameter]], mesh) -> tuple[torch.device, str | None]:
    """The device the parameters' local tensors live on (a DTensor's local shard), where dmuon puts its
    buffers and runs its collectives, and an error message when they live on several.

    From the parameters, not from ``torch.cuda.current_device()``: a script may call ``prepare``
    before ``torch.cuda.set_device``, and every rank's buffers would then land on ``cuda:0``. The
    chosen matrices decide; without any, the model's parameters; without those, the mesh's device
    type (the current CUDA device for ``"cuda"``: there is nothing else to go by).
    """
    named = chosen or list(model.named_parameters())
    where: dict[torch.device, str] = {}
    for name, p in named:
        local = p.to_local() if isinstance(p, DTensor) else p
        where.setdefault(local.device, name)
    if len(where) > 1:
        listed = ", ".join(f"{name!r} on {dev}" for dev, name in where.items())
        return next(iter(where)), (f"dmuon.prepare: the parameters live on different devices ({listed}); "
                                   "dmuon needs every parameter on this rank's one device")
    if where:
        return next(iter(where)), None
    if mesh is None:
        return torch.device("cpu"), None
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device()), None
    return torch.device(mesh.device_type), None


def _check_hsdp_mesh(meshes: list[tuple[str, object]], params_mesh, hsdp_mesh):
    """The mesh dmuon's groups are made over when the parameters live on ``hsdp_mesh``'s non-replicate dims
    (dmuon reduces across its dim 0): ``hsdp_mesh`` itself, or with several views of one root (expert
    parallelism: a tuple, :func:`dmuon.plan.layout.hsdp_meshes`) the first, each parameter's mesh a slice
    of one view's non-replicate dims.

    Raises:
        ValueError: Naming what to change: a mesh that is not (replicate, shard, ...) with names,
            a model sharded over the whole HSDP mesh (FSDP2's native HSDP), or over another mesh;
            views whose replicate dims or ranks differ.
    """
    from torch.distributed.device_mesh import DeviceMesh

    views = hsdp_meshes(hsdp_mesh)
    for view in views:
        if not isinstance(view, DeviceMesh) or view.ndim < 2 or view.mesh_dim_names is None:
            raise ValueError("hsdp_mesh must be a DeviceMesh with named dims (replicate, shard[, tp...]), e.g. "
                             "init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard')), or a "
                             "tuple of such views of one root sharing their replicate dim")
    if len(views) > 1:
        return _check_hsdp_views(meshes, views)
    inner = hsdp_mesh[tuple(hsdp_mesh.mesh_dim_names[1:])] if hsdp_mesh.ndim > 2 else \
        hsdp_mesh[hsdp_mesh.mesh_dim_names[1]]
    if params_mesh == hsdp_mesh:
        raise ValueError("the model is fully_shard-ed over the whole hsdp_mesh (FSDP2's native HSDP, which "
                         "all-reduces gradients across replicas itself); for dmuon's replicate level shard it "
                         f"over hsdp_mesh[{hsdp_mesh.mesh_dim_names[1]!r}] (fully_shard(..., mesh="
                         f"hsdp_mesh[{hsdp_mesh.mesh_dim_names[1]!r}])), or drop hsdp_mesh= to keep native HSDP")
    if params_mesh != inner and hsdp_mesh.mesh.numel() != params_mesh.mesh.numel() * hsdp_mesh.size(0):
        raise ValueError(f"hsdp_mesh {hsdp_mesh} holds {hsdp_mesh.mesh.numel()} ranks, not the parameters' data-parallel "
                         f"group ({params_mesh.mesh.numel()} ranks) times its {hsdp_mesh.size(0)} replicas: pass "
                         "the (replicate, shard) mesh of this model part's data-parallel ranks only (under pipeline "
                         "parallelism the stage's, e.g. world_mesh['replicate', 'shard'] of a (pp, replicate, "
                         "shard) mesh), not one that spans other stages")
    if params_mesh != inner:
        raise ValueError(f"the parameters live on {params_mesh}, not on hsdp_mesh's non-replicate dims "
                         f"{hsdp_mesh.mesh_dim_names[1:]} ({inner}); shard the model over "
                         f"hsdp_mesh[{hsdp_mesh.mesh_dim_names[1]!r}] of the hsdp_mesh you pass")
    return hsdp_mesh


def _check_hsdp_views(meshes: list[tuple[str, object]], views: tuple) -> object:
    """Several ``hsdp_mesh`` views (:func:`_check_hsdp_mesh`): the same replicate dim over the same ranks,
    and every parameter's mesh the slice of one view's non-replicate dims. Returns the first view."""
    first = views[0]
    ranks = sorted(first.mesh.flatten().tolist())
    for view in views[1:]:
        if view.mesh_dim_names[0] != first.mesh_dim_names[0] or view.size(0) != first.size(0) \
                or sorted(view.mesh.flatten().tolist()) != ranks or root_mesh(view) != root_mesh(first):
            raise ValueError(f"the hsdp_mesh views {first} and {view} differ in their replicate dim (name, size) "
                             "or their ranks or root: pass views of one root mesh that share their replicate dim")
    for name, mesh in meshes:
        dims = tuple(mesh.mesh_dim_names or ())
        if any(mesh == view for view in views):
            raise ValueError(f"parameter {name!r} is fully_shard-ed over a whole hsdp_mesh view ({mesh}: FSDP2's "
                             "native HSDP); for dmuon's replicate level shard it over the view's non-replicate dims")
        held = [view for view in views if dims and set(dims) <= set(view.mesh_dim_names[1:]) and view[dims] == mesh]
        if not held:
            raise ValueError(f"parameter {name!r} lives on {mesh}, not on the non-replicate dims of any hsdp_mesh "
                             f"view ({', '.join(str(v) for v in views)})")
    return first


def _check_not_a_replica(mesh, name: str) -> None:
    """Raises when the parameters' mesh is a slice of a mesh whose other dims include a replicate dim
    (``"replicate"``, torchtitan's ``"dp_replicate"``): the ranks along it hold other replicas of this
    model, whose gradients nothing would reduce with these (a model sharded over ``mesh["shard"]``
    without ``hsdp_mesh=``). A slice along any other dim (a pipeline stage's ``"dp"`` of a
    ``(pp, dp)`` mesh) is a data-parallel group of its own."""
    parent = root_mesh(mesh)
    if parent is mesh or parent.mesh_dim_names is None:
        return
    others = [d for d in parent.mesh_dim_names if d not in (mesh.mesh_dim_names or ())]
    replicas = [d for d in others if "replicate" in d]
    if replicas:
        shard = ", ".join(repr(d) for d in (mesh.mesh_dim_names or ()))
        raise ValueError(
            f"parameter {name!r} is fully_shard-ed over the {shard} dims of a mesh whose {replicas[0]!r} dim holds "
            "other replicas of this model, and nothing would reduce the gradients across them: pass "
            f"hsdp_mesh=mesh[({replicas[0]!r}, {shard})] (dmuon's replicate level), or fully_shard over both "
            "dims (FSDP2's own HSDP)")


def check_no_all_reduce_hook(model: nn.Module) -> None:
    """dmuon reduces every gradient across replicas itself; an FSDP2 all-reduce hook of the user's
    (``FSDPModule.set_all_reduce_hook``) would reduce them a second time.

    FSDP2 has no public getter for the hook, so this reads its param groups' attribute (a check
    only: nothing is changed).
    """
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        if has_all_reduce_hook(module):
            raise ValueError(f"module {name or '<root>'!r} has an FSDP2 all-reduce hook (set_all_reduce_hook); "
                             "with hsdp_mesh= dmuon reduces gradients across replicas itself, so remove the hook")


def layout_of(model: nn.Module, hsdp_mesh=None):
    """The mesh spanning every DTensor parameter, and whether its dim 0 replicates (HSDP).

    The mesh may be any group of ranks: the world, or one pipeline stage's data-parallel ranks
    (dmuon's groups are made over the mesh's ranks only, :func:`dmuon.comm.topology.from_mesh`).

    With ``hsdp_mesh`` (dmuon's replicate level) the parameters live on its
    non-replicate dims and ``hsdp_mesh`` is returned.

    FSDP2 alone puts every parameter on one mesh; with tensor parallelism the
    parameters TP split live on the ``(dp..., tp)`` mesh and the others on its
    ``dp`` sub-mesh; with expert parallelism the experts live on ``(efsdp, ep)``
    and the dense parameters on ``fsdp``, views of one root: the mesh returned is
    the one spanning the data-parallel group (:func:`spanning_mesh`). Returns ``(None, False)`` for a model without DTensors.

    Raises:
        ValueError: For trainable plain parameters in a multi-process run (not
            under ``fully_shard``), meta parameters, or meshes of no common root
            (:func:`spanning_mesh`).
    """
    meshes: list[tuple[str, object]] = []
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device: materialize weights first")
        if not isinstance(p, DTensor):
            if distributed and p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} is not managed by any fully_shard: call fully_shard on the model "
                    "(and its blocks) before dmuon.prepare (a DMuon built before sharding sets itself up at "
                    "the model's first forward, after your framework has sharded it)"
                )
            continue
        if not any(m == p.device_mesh for _, m in meshes):
            meshes.append((name, p.device_mesh))
    if not meshes:
        return None, False
    first, root = spanning_mesh(meshes)
    names = root.mesh_dim_names
    if hsdp_mesh is not None:
        return _check_hsdp_mesh(meshes, root, hsdp_mesh), True
    _check_not_a_replica(root, first)
    replicated = root.ndim >= 2
    for _, p in model.named_parameters():
        if isinstance(p, DTensor) and replicated:
            dims = p.device_mesh.mesh_dim_names
            on_root_dim0 = p.device_mesh == root or (dims is not None and names is not None and dims[0] == names[0])
            if on_root_dim0 and not isinstance(p.placements[0], Replicate):
                replicated = False
    return root, replicated


def spanning_mesh(meshes: list[tuple[str, object]]) -> tuple[str, object]:
    """The mesh of the data-parallel group among the parameters' meshes (each with the first parameter
    on it): the one holding the most ranks (then the fewest dims), with every other mesh cut from the same
    root mesh over ranks inside it.

    One mesh (FSDP2 alone), a mesh and its named sub-meshes (tensor parallelism: ``(dp, tp)`` and
    ``dp``), or several views of one root (expert parallelism as torchtitan lays it out: the dense
    parameters on ``fsdp``, the routed experts on ``(efsdp, ep)``, both unflattened from the world
    mesh): dmuon reads each parameter's place from its own mesh and placements, so any of these is one
    layout. Meshes of no common root cannot be told apart from two models, nor related rank by rank.

    Raises:
        ValueError: Meshes with no common root, or ranks outside the spanning mesh.
    """
    # Of meshes over the same ranks (torchtitan's dense fsdp and expert (efsdp, ep) views), the one of
    # fewest dims: a 1-D mesh has a process group over exactly its ranks, which dmuon's own groups are
    # split from when the mesh is a part of the world (comm/topology.py).
    first, root = max(meshes, key=lambda nm: (nm[1].mesh.numel(), -nm[1].ndim))
    origin = root_mesh(root)
    ranks = set(root.mesh.flatten().tolist())
    for name, mesh in meshes:
        if mesh == root:
            continue
        if root_mesh(mesh) != origin:
            raise ValueError(f"parameters {first!r} and {name!r} live on DeviceMeshes with no common root "
                             f"({root} and {mesh}); dmuon needs every parameter's mesh cut from one mesh "
                             "(init_device_mesh once, then sliced, flattened or unflattened from it)")
        if not set(mesh.mesh.flatten().tolist()) <= ranks:
            raise ValueError(f"parameters {first!r} and {name!r} live on two different data-parallel groups "
                             f"(ranks {root.mesh.flatten().tolist()} and {mesh.mesh.flatten().tolist()}): one "
                             "DMuon steps one data-parallel group's parameters; build one per model part "
                             "(each part fully_shard-ed over its own stage's mesh)")
    return first, root


EXPERT_PARALLEL_DIM = "ep"
"""The mesh dim name that marks expert parallelism (torchtitan's): a stack's experts split whole over it."""


def check_expert_split(name: str, p: torch.Tensor) -> None:
    """An expert stack viewed per expert: split over the ``ep`` mesh dim, it must be split along its expert
    dim (``Shard(0)``), so that each ep rank holds whole experts and routes tokens to them.

    Split along another dim, each ep rank would hold a part of every expert while the forward dispatches
    tokens by expert: a layout no MoE layer computes, whose gradients dmuon cannot read as experts'.

    Raises:
        ValueError: Naming the parameter and its placement on ``ep``.
    """
    if not isinstance(p, DTensor) or EXPERT_PARALLEL_DIM not in (p.device_mesh.mesh_dim_names or ()):
        return
    placement = p.placements[p.device_mesh.mesh_dim_names.index(EXPERT_PARALLEL_DIM)]
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise ValueError(f"parameter {name!r}: an expert stack split over the {EXPERT_PARALLEL_DIM!r} mesh dim "
                         f"by {placement!r}, not along its expert dim; expert parallelism keeps whole experts on "
                         f"each ep rank: distribute it with Shard(0) over {EXPERT_PARALLEL_DIM!r} (torchtitan's "
                         "ExpertParallel), or view it otherwise (matrix_view)")


def momentum_layout(param: DTensor, param_dim: int, hsdp_mesh=None) -> tuple:
    """HSDP: the momentum's ``(mesh, placements)``: the parameter's, with the replicate dim a split of
    ``param_dim`` (the momentum's columns), inside any split of that dim by later mesh dims (tensor
    parallel: ``_StridedShard``, as FSDP2 marks its rows inside TP's).

    On native HSDP the parameter's replicate dim (``Replicate``) becomes the split; with dmuon's
    replicate level (``hsdp_mesh``: the parameter lives on its non-replicate dims) the split is
    prepended, on ``hsdp_mesh``.
    """
    mesh, placements = param.device_mesh, list(param.placements)
    if hsdp_mesh is not None:
        mesh, placements = replicated_mesh(hsdp_mesh, param), [Replicate(), *placements]
    split = 1
    for j in range(1, mesh.ndim):
        if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == param_dim:
            split *= mesh.size(j)
    placements[0] = _StridedShard(param_dim, split_factor=split) if split > 1 else Shard(param_dim)
    return mesh, tuple(placements)


def fsdp_blocks(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Each ``fully_shard``-ed module with the parameters it manages itself (not its FSDP children's)."""
    blocks = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        nested = {
            id(p)
            for child_name, child in module.named_modules()
            if child is not module and isinstance(child, FSDPModule)
            for p in child.parameters()
        }
        blocks.append((name, module, [p for p in module.parameters() if id(p) not in nested]))
    return blocks
