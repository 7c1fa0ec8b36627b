"""``dmuon.prepare``: read the sharded model, choose the Muon matrices, assign owners."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
# Where a DTensor's local shard sits in the global tensor (the function DCP plans its chunks with).
from dmuon.util.torch_compat import has_all_reduce_hook, local_shape_and_offset, strided_shard_type
# FSDP2 marks its row split inside a tensor-parallel one with _StridedShard; the momentum's
# column split inside TP's is the same kind of layout.
_StridedShard = strided_shard_type()

from dmuon.comm.topology import Topology, from_mesh, single_process
from dmuon.ortho.config import NSConfig
from dmuon.plan.assign import assign
from dmuon.plan.balance import BALANCERS
from dmuon.plan.layout import replicated_mesh
from dmuon.plan.plan import BlockInfo, MatrixInfo, Piece, Plan, ReductionGroup
from dmuon.plan.selection import SelectFn, ViewFn, matrix_views, row_sizes, select_matrices


def _fingerprint(model: nn.Module, chosen: list[str], balancer: str, ns: NSConfig) -> torch.Tensor:
    h = hashlib.sha256(f"{balancer}|{sorted(ns.cache_key().items())}|{','.join(chosen)}".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(torch.int64)


def _check_same_everywhere(fingerprint: torch.Tensor, topology: Topology, device) -> None:
    world_size = topology.world_size
    gathered = torch.zeros(world_size * fingerprint.numel(), dtype=fingerprint.dtype, device=device)
    # torch 2.13 renamed all_gather_into_tensor; keep older releases working.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, fingerprint.to(device), group=topology.world_group)
    rows = gathered.view(world_size, -1).cpu()
    differing = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differing:
        raise ValueError(
            "dmuon.prepare: ranks disagree on the model's parameters (names, shapes, dtypes, "
            f"requires_grad, order) or on prepare's arguments; ranks {differing} differ from rank 0"
        )


def _parameter_device(model: nn.Module, chosen: list[tuple[str, nn.Parameter]], mesh) -> tuple[torch.device, str | None]:
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


def _check_hsdp_mesh(params_mesh, hsdp_mesh):
    """``hsdp_mesh`` when the parameters live on its non-replicate dims (dmuon reduces across its dim 0).

    Raises:
        ValueError: Naming what to change: a mesh that is not (replicate, shard, ...) with names,
            a model sharded over the whole HSDP mesh (FSDP2's native HSDP), or over another mesh.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(hsdp_mesh, DeviceMesh) or hsdp_mesh.ndim < 2 or hsdp_mesh.mesh_dim_names is None:
        raise ValueError("hsdp_mesh must be a DeviceMesh with named dims (replicate, shard[, tp...]), e.g. "
                         "init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard'))")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if hsdp_mesh.mesh.numel() != world:
        raise ValueError(f"hsdp_mesh holds {hsdp_mesh.mesh.numel()} ranks but the default process group {world}; "
                         "dmuon needs a mesh over every rank")
    inner = hsdp_mesh[tuple(hsdp_mesh.mesh_dim_names[1:])] if hsdp_mesh.ndim > 2 else \
        hsdp_mesh[hsdp_mesh.mesh_dim_names[1]]
    if params_mesh == hsdp_mesh:
        raise ValueError("the model is fully_shard-ed over the whole hsdp_mesh (FSDP2's native HSDP, which "
                         "all-reduces gradients across replicas itself); for dmuon's replicate level shard it "
                         f"over hsdp_mesh[{hsdp_mesh.mesh_dim_names[1]!r}] (fully_shard(..., mesh="
                         f"hsdp_mesh[{hsdp_mesh.mesh_dim_names[1]!r}])), or drop hsdp_mesh= to keep native HSDP")
    if params_mesh != inner:
        raise ValueError(f"the parameters live on {params_mesh}, not on hsdp_mesh's non-replicate dims "
                         f"{hsdp_mesh.mesh_dim_names[1:]} ({inner}); shard the model over "
                         f"hsdp_mesh[{hsdp_mesh.mesh_dim_names[1]!r}] of the hsdp_mesh you pass")
    return hsdp_mesh


def _check_no_all_reduce_hook(model: nn.Module) -> None:
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


def _layout_of(model: nn.Module, hsdp_mesh=None):
    """The mesh spanning every DTensor parameter, and whether its dim 0 replicates (HSDP).

    With ``hsdp_mesh`` (dmuon's replicate level) the parameters live on its
    non-replicate dims and ``hsdp_mesh`` is returned.

    FSDP2 alone puts every parameter on one mesh; with tensor parallelism the
    parameters TP split live on the ``(dp..., tp)`` mesh and the others on its
    ``dp`` sub-mesh. Returns ``(None, False)`` for a model without DTensors.

    Raises:
        ValueError: For trainable plain parameters in a multi-process run (not
            under ``fully_shard``), meta parameters, or meshes that are not one
            mesh and its named sub-meshes.
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
    first, root = max(meshes, key=lambda nm: nm[1].ndim)
    names = root.mesh_dim_names
    for name, mesh in meshes:
        if mesh == root:
            continue
        if names is None or mesh.mesh_dim_names is None or not set(mesh.mesh_dim_names) <= set(names):
            raise ValueError(f"parameter {name!r} lives on a DeviceMesh that is not a named sub-mesh of "
                             f"{first!r}'s; dmuon needs the parameters on one mesh and its sub-meshes")
    if hsdp_mesh is not None:
        return _check_hsdp_mesh(root, hsdp_mesh), True
    if root.mesh.numel() != (dist.get_world_size() if dist.is_initialized() else 1):
        raise ValueError(f"the parameters' mesh holds {root.mesh.numel()} ranks but the default process group "
                         f"{dist.get_world_size()}; dmuon needs a mesh over every rank (HSDP with dmuon reducing "
                         "across replicas: fully_shard over the shard dim of an HSDP mesh and pass hsdp_mesh=)")
    replicated = root.ndim >= 2
    for _, p in model.named_parameters():
        if isinstance(p, DTensor) and replicated:
            dims = p.device_mesh.mesh_dim_names
            on_root_dim0 = p.device_mesh == root or (dims is not None and dims[0] == names[0])
            if on_root_dim0 and not isinstance(p.placements[0], Replicate):
                replicated = False
    return root, replicated


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


def _local_box(p: torch.Tensor, width: int) -> list[int]:
    """``[ok, offsets..., sizes...]`` of this rank's local shard of ``p`` (``width`` dims, padded)."""
    if not isinstance(p, DTensor):
        shape, offset, ok = tuple(p.shape), (0,) * p.ndim, True
    else:
        shape, offset = local_shape_and_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        ok = tuple(local.shape) == tuple(shape) and local.is_contiguous()
    pad = [0] * (width - len(shape))
    return [int(ok), *offset, *pad, *shape, *pad]


def _momentum_ok(info: MatrixInfo, s: int, r: int, hsdp_mesh) -> bool:
    """HSDP: whether :func:`momentum_layout` gives rank ``(r, s)`` exactly its slice of the piece."""
    p, d, piece = info.param, info.param_dim, info.pieces[s]
    if not piece.rows:
        return True  # nothing of this matrix here
    shape, offset = local_shape_and_offset(p.shape, *momentum_layout(p, d, hsdp_mesh))
    return shape[d] == info.replica_columns(s)[r] and offset[d] == piece.col + info.column_start(r, s)


def _gather_boxes(chosen: list[tuple[str, nn.Parameter]], topology: Topology, device) -> list[list[list[int]]]:
    """Every plan rank's local box of every chosen parameter: ``boxes[rank][k] = [ok, offsets, sizes]``.

    Each rank knows only its own shard's place (torch's
    ``compute_local_shape_and_global_offset``); one all-gather tells every rank all of them.
    """
    width = max((p.ndim for _, p in chosen), default=1)
    mine = [_local_box(p, width) for _, p in chosen]
    if topology.world_size == 1:
        return [mine]
    flat = torch.tensor(mine, dtype=torch.int64).reshape(-1)
    gathered = torch.zeros(topology.world_size * flat.numel(), dtype=torch.int64, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, flat.to(device), group=topology.world_group)
    # The group orders its members by global rank; plan ranks follow the mesh.
    by_global = gathered.cpu().view(topology.world_size, len(chosen), 1 + 2 * width).tolist()
    position = {g: k for k, g in enumerate(sorted(topology.global_ranks))}
    return [by_global[position[g]] for g in topology.global_ranks]


def _pieces(name: str, p: torch.Tensor, boxes: list[list[int]], expert: int | None,
            shard: int, rows_of: tuple[int, int] | None = None) -> tuple[tuple[Piece, ...], tuple[int, ...]]:
    """The matrix's piece on each shard position from the gathered boxes (``[ok, offsets, sizes]``).

    ``expert`` picks one slice of a stack; ``rows_of = (first, count)`` one row group of a
    ``"rows:K"`` view. Also returns, per position, the stack's first local expert or the
    group's first local row.

    Raises:
        ValueError: A trailing dim is split, or the distinct pieces do not tile the matrix.
    """
    width = (len(boxes[0]) - 1) // 2
    lead = 0 if expert is None else 1  # a stack's dim 0 picks the expert
    shape = tuple(p.shape[lead:])
    if rows_of is not None:
        shape = (rows_of[1], *shape[1:])
    pieces, starts = [], []
    for box in boxes[:shard]:
        offset, size = box[1 : 1 + p.ndim], box[1 + width : 1 + width + p.ndim]
        for d in range(lead + 2, p.ndim):
            if offset[d] != 0 or size[d] != p.shape[d]:
                raise ValueError(f"parameter {name!r} is split on its dim {d}; dmuon needs a matrix's dims "
                                 f"after the first two whole on every rank")
        starts.append(offset[0])
        row, rows, cols = offset[lead], size[lead], (size[lead + 1] if len(shape) > 1 else 1)
        if expert is not None and not offset[0] <= expert < offset[0] + size[0]:
            rows = 0  # not this expert; its columns still say how the stack's momentum splits here
        if rows_of is not None:
            # This position's rows of the group: where its box and the group overlap.
            first, count = rows_of
            low, high = max(row, first), min(row + rows, first + count)
            overlap = max(0, high - low)
            starts[-1] = low - row if overlap else 0
            row, rows = (low - first if overlap else 0), overlap
        pieces.append(Piece(row, rows, offset[lead + 1] if len(shape) > 1 else 0, cols))
    seen: set[tuple[int, int, int, int]] = set()
    out = []
    for piece in pieces:
        key = (piece.row, piece.rows, piece.col, piece.cols)
        out.append(Piece(*key, sends=key not in seen))
        if piece.rows * piece.cols:
            seen.add(key)
    if not _tiles(seen, shape[0], shape[1] if len(shape) > 1 else 1):
        placements = tuple(p.placements) if isinstance(p, DTensor) else ()
        raise ValueError(f"parameter {name!r}: its local shards (placements {placements}) are not contiguous "
                         "boxes of the matrix, a layout dmuon does not support")
    return tuple(out), tuple(starts)


def _tiles(boxes, rows: int, cols: int) -> bool:
    """Whether the ``(row, rows, col, cols)`` boxes cover the ``rows x cols`` matrix exactly once.

    On the grid of the boxes' own edges (at most one cell per pair of edges),
    a 2-D difference array counts how often each cell is covered: linear in the
    boxes plus the grid, so thousands of ranks' pieces check in milliseconds.
    """
    boxes = np.array(sorted(boxes), dtype=np.int64).reshape(-1, 4)
    if rows * cols == 0:
        return len(boxes) == 0
    r0, r1, c0, c1 = boxes[:, 0], boxes[:, 0] + boxes[:, 1], boxes[:, 2], boxes[:, 2] + boxes[:, 3]
    if len(boxes) == 0 or r0.min() < 0 or c0.min() < 0 or r1.max() > rows or c1.max() > cols:
        return False
    row_edges = np.unique(np.concatenate([[0, rows], r0, r1]))
    col_edges = np.unique(np.concatenate([[0, cols], c0, c1]))
    a, b = np.searchsorted(row_edges, r0), np.searchsorted(row_edges, r1)
    c, d = np.searchsorted(col_edges, c0), np.searchsorted(col_edges, c1)
    diff = np.zeros((len(row_edges), len(col_edges)), dtype=np.int64)
    np.add.at(diff, (a, c), 1)
    np.add.at(diff, (b, c), -1)
    np.add.at(diff, (a, d), -1)
    np.add.at(diff, (b, d), 1)
    cover = diff.cumsum(0).cumsum(1)[:-1, :-1]
    return bool((cover == 1).all())


def _fsdp_blocks(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
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


def prepare(
    model: nn.Module,
    *,
    select: SelectFn | None = None,
    matrix_view: ViewFn | dict[str, str] | None = None,
    balancer: str = "greedy",
    ns: NSConfig | None = None,
    profile: bool = False,
    cost_table=None,
    time_limit_s: float = 10.0,
    memory_factor: float | None = 1.25,
    cache_dir=None,
    hsdp_mesh=None,
) -> Plan:
    """Reads a ``fully_shard``-ed model, selects its Muon matrices and assigns each one owner.

    Call it on every rank after ``fully_shard`` (exactly as for AdamW) and pass
    the plan to :class:`dmuon.DMuon`; ``DMuon(model)`` calls it with the defaults.

    Args:
        model: The model: every trainable parameter a DTensor of one mesh or its
            named sub-meshes (1-D FSDP, 2-D ``(replicate, shard)`` HSDP, with a
            tensor- or expert-parallel dim after them), or plain tensors in a
            single process.
        select: ``select(name, param) -> bool`` overriding the default matrix rule.
            Parameters with ``requires_grad=False`` are never Muon matrices.
        matrix_view: How each chosen parameter is seen: ``"flatten"`` (one
            ``(shape[0], prod(shape[1:]))`` matrix, the default for 2-D parameters
            and ``nn.Conv*`` weights), ``"stack"`` (``shape[0]`` experts, each its
            own ``shape[1:]`` matrix with its own owner, the default for other
            parameters of three or more dims), ``"rows:K"`` (K equal row groups,
            each its own matrix and owner: a fused QKV per part, ``"rows:3"``, or
            per head) or row groups of given sizes, ``"rows:q,k,v"`` or a tuple
            ``(q, k, v)`` (a fused GQA QKV; the sizes must sum to the rows). A
            function ``(name, param) -> view`` or a dict by parameter name (others
            keep the default).
        balancer: ``"greedy"``/``"lpt"`` (longest-processing-time first),
            ``"milp"`` (HiGHS: minimize the slowest rank, then the total),
            ``"auto"`` (MILP when small enough, else LPT) or ``"round_robin"``.
        ns: How the owners will run Newton-Schulz (default: ``NSConfig()``, DMuon's
            defaults): the costs are priced, or with ``profile=True`` measured,
            with it, and :class:`dmuon.DMuon` given this plan runs it.
        profile: Measure the owner update per (shape, batch) on this device
            (rank 0 measures and broadcasts; cached on disk) instead of using
            the analytical FLOP model.
        cost_table: A :class:`~dmuon.plan.profile.CostTable` measured elsewhere.
        time_limit_s: MILP time limit; the best solution found is kept.
        memory_factor: Cap on the owner workspace a rank holds, as a multiple of
            the mean (None: no cap).
        cache_dir: Profile cache directory (default ``$DMUON_CACHE_DIR`` or ``~/.cache/dmuon``).
        hsdp_mesh: HSDP with dmuon's replicate level: the ``(replicate, shard[, tp])``
            DeviceMesh whose non-replicate dims the model is ``fully_shard``-ed over
            (``mesh=hsdp_mesh["shard"]``). dmuon then reduces every gradient across the
            replicas itself, each Muon matrix only as far as its owner needs, instead of
            FSDP2's all-reduce (``docs/architecture.md``, "HSDP"). None: the mesh the
            parameters live on (FSDP2's native HSDP when it is 2-D).

    Returns:
        The :class:`~dmuon.plan.Plan`.

    Raises:
        ValueError: For bad arguments, parameters outside ``fully_shard``,
            unsupported layouts (named), or ranks whose models differ; raised
            on every rank.
    """
    if balancer not in BALANCERS:
        raise ValueError(f"balancer must be one of {BALANCERS}, got {balancer!r}")
    if ns is None:
        ns = NSConfig()
    elif not isinstance(ns, NSConfig):
        raise ValueError(f"ns must be a dmuon.NSConfig, got {type(ns).__name__}")
    mesh, replicated = _layout_of(model, hsdp_mesh)
    if hsdp_mesh is not None:
        _check_no_all_reduce_hook(model)
    topology = single_process() if mesh is None else from_mesh(mesh, replicated)
    chosen = [(n, p) for n, p in select_matrices(model, select) if p.requires_grad]
    views = matrix_views(model, chosen, matrix_view)
    device, mixed = _parameter_device(model, chosen, mesh)
    topology.warm_up(device)  # dmuon's communicators exist before the first backward
    if topology.world_size > 1:
        # Whether this rank's parameters share one device is part of what every rank compares, so
        # a rank with mixed devices makes every rank raise, none waits in a collective for it.
        chosen_views = [f"{n}:{views[n]}" for n, _ in chosen] + [f"hsdp_mesh:{hsdp_mesh is not None}",
                                                                 f"one_device:{mixed is None}"]
        try:
            _check_same_everywhere(_fingerprint(model, chosen_views, balancer, ns), topology, device)
        except ValueError:
            if mixed is not None:
                raise ValueError(mixed) from None
            raise
    if mixed is not None:
        raise ValueError(mixed)

    if mesh is None:
        block_list = [("", model, list(model.parameters()))]
    else:
        block_list = _fsdp_blocks(model)
    block_of: dict[int, int] = {}
    for b, (_, _, params) in enumerate(block_list):
        for p in params:
            block_of[id(p)] = b
    blocks = [BlockInfo(b, name, module) for b, (name, module, _) in enumerate(block_list)]

    for name, p in chosen:
        if id(p) not in block_of:
            raise ValueError(f"parameter {name!r} is not managed by any fully_shard module")
    boxes = _gather_boxes(chosen, topology, device)
    bad = [name for k, (name, _) in enumerate(chosen) if not all(rank[k][0] for rank in boxes)]
    if bad:
        raise ValueError(f"parameters {bad[:5]}: a local shard is not where its DTensor placements put it "
                         "(or not contiguous), a layout dmuon does not support")
    infos = []
    shard = topology.shard
    for k, (name, p) in enumerate(chosen):
        for r in range(1, topology.replicate):
            if [b[k] for b in boxes[r * shard : (r + 1) * shard]] != [b[k] for b in boxes[:shard]]:
                raise ValueError(f"parameter {name!r}: replica {r} holds other shards than replica 0; "
                                 "dmuon needs the replicate dim to replicate every parameter")
        column = [b[k] for b in boxes]
        sizes = row_sizes(views[name], p.shape[0])
        if sizes:
            matrices = []
            for g, (first, height) in enumerate(zip(itertools.accumulate((0, *sizes)), sizes)):
                pieces, starts = _pieces(name, p, column, None, shard, rows_of=(first, height))
                matrices.append(MatrixInfo(len(infos) + g, f"{name}[rows {first}:{first + height}]", p,
                                           (height, *p.shape[1:]), block_of[id(p)], pieces=pieces, group=g,
                                           group_starts=starts, replicate=topology.replicate))
        elif views[name] == "flatten":
            pieces, _ = _pieces(name, p, column, None, shard)
            matrices = [MatrixInfo(len(infos), name, p, tuple(p.shape), block_of[id(p)], pieces=pieces,
                                   replicate=topology.replicate)]
        else:
            matrices = []
            for e in range(p.shape[0]):
                pieces, starts = _pieces(name, p, column, e, shard)
                matrices.append(MatrixInfo(len(infos) + e, f"{name}[{e}]", p, tuple(p.shape[1:]), block_of[id(p)],
                                           pieces=pieces, expert=e, stack_starts=starts,
                                           replicate=topology.replicate))
        for info in matrices:
            infos.append(info)
            blocks[info.block].members.append(info.index)
    if topology.replicate > 1:
        r, s_ = topology.coords
        # Each rank can check only its own momentum shard: one all-reduce puts every rank on the error.
        ok = torch.tensor([int(_momentum_ok(info, s_, r, hsdp_mesh)) for info in infos] or [1], dtype=torch.int32).to(device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=topology.world_group)
        bad = sorted({infos[k].name.split("[")[0] for k, v in enumerate(ok.cpu().tolist()) if not v and infos})
        if bad:
            raise ValueError(f"parameters {bad[:5]}: no DTensor layout splits their momentum's columns over the "
                             "replicas inside their tensor-parallel split; dmuon does not support it")
    blocks = [b for b in blocks if b.members]
    renumber = {b.index: k for k, b in enumerate(blocks)}
    for k, b in enumerate(blocks):
        b.index = k
    for info in infos:
        info.block = renumber[info.block]
    # What FSDP2 reduces together, every trainable parameter included: dmuon's replicate level
    # reduces these groups (with hsdp_mesh), the Muon matrices' block by block.
    groups = [ReductionGroup(name, [p for p in params if p.requires_grad], renumber.get(b))
              for b, (name, _, params) in enumerate(block_list) if any(p.requires_grad for p in params)]
    balance = assign(
        infos, topology.world_size, balancer, ns_steps=ns.steps, costs=cost_table, profile=profile,
        ns_kwargs=ns.kwargs(), group=topology.world_group if topology.world_size > 1 else None,
        time_limit_s=time_limit_s, memory_factor=memory_factor, cache_dir=cache_dir,
        replicate=topology.replicate,
    )
    plan = Plan(infos, blocks, topology.world_size, topology.rank, balancer, topology.replicate, mesh)
    plan.balance_result = balance
    plan.param_names = tuple(n for n, _ in model.named_parameters())
    plan.topology = topology
    plan.device = device
    plan.ns = ns
    plan.hsdp_mesh = hsdp_mesh
    plan.groups = groups
    return plan
