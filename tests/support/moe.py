"""A Mixture-of-Experts model laid out as torchtitan trains it, and its one-process reference.

The layout (torchtitan's ``apply_fsdp`` + ``ExpertParallel`` + ``ParallelDims``): every data rank reads
its own batch; the dense parameters (embedding, mixing, router, shared expert, norm, head) are
``fully_shard``-ed over an ``fsdp`` dim of every data rank; the routed experts, ``(E, m, n)`` stacks, are
split over an ``ep`` dim with ``Shard(0)`` (whole experts per ep rank; tokens reach them by all-to-all in
the forward) and ``fully_shard``-ed over the remaining ``efsdp`` dim (on dim 1 when ``efsdp * ep > E``),
with the gradient divided by the whole data-parallel size. Dense and expert meshes are two unflattenings
of one world mesh (neither is a named sub-mesh of the other).

The reference trains the same model in one process on the global batch with ``torch.optim.Muon`` on each
expert's ``(m, n)`` slice and every dense matrix, ``torch.optim.AdamW`` on the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from support.reference import ns_precision

VOCAB, DIM, HIDDEN, SHARED = 23, 8, 12, 6
TOP_K = 2
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
ADAMW = dict(lr=3e-3, weight_decay=0.01, betas=(0.9, 0.999))


class RoutedExperts(nn.Module):
    """``experts`` SwiGLU-free MLPs as two stacks, ``w1 (E, HIDDEN, DIM)`` and ``w2 (E, DIM, HIDDEN)``.

    Split over ep (``Shard(0)`` on a mesh dim named ``"ep"``), each rank computes only its own experts:
    the routed tokens go to the rank holding their expert and come back by ``all_to_all_single`` (with
    autograd), as torchtitan's token dispatch does. ``dead``: experts no token is routed to."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.etp_group = None  # set by _local from the stacks' mesh (expert tensor parallelism)
        self.w1 = nn.Parameter(torch.randn(experts, HIDDEN, DIM) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, DIM, HIDDEN) / HIDDEN ** 0.5)

    def _local(self):
        """This rank's experts (a range of expert ids) and their stacks, and the ep group (None: all here)."""
        w1, w2 = self.w1, self.w2
        if not isinstance(w1, DTensor) or "ep" not in (w1.device_mesh.mesh_dim_names or ()):
            full = [t.full_tensor() if isinstance(t, DTensor) else t for t in (w1, w2)]
            return range(self.num_experts), full[0], full[1], None
        mesh = w1.device_mesh
        group = mesh.get_group("ep")
        size, me = dist.get_world_size(group), dist.get_rank(group)
        per = -(-self.num_experts // size)  # Shard(0): torch.chunk's rule
        first = min(self.num_experts, me * per)
        self.etp_group = mesh.get_group("etp") if "etp" in mesh.mesh_dim_names else None
        return range(first, min(self.num_experts, first + per)), w1.to_local(), w2.to_local(), group

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """``x (R, DIM)`` routed rows, ``expert (R,)`` their experts; each row's expert output."""
        mine, w1, w2, group = self._local()
        if group is None:
            return self._compute(x, expert, mine, w1, w2)
        size = dist.get_world_size(group)
        per = -(-self.num_experts // size)
        owner = torch.div(expert, per, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        rows = all_to_all_single_autograd(x[order].contiguous(), recv_sizes, send_sizes, group)
        ids = expert.new_empty(sum(recv_sizes))
        dist.all_to_all_single(ids, expert[order].contiguous(), recv_sizes, send_sizes, group=group)
        if self.etp_group is None:
            out = self._compute(rows, ids, mine, w1, w2)
        else:
            # Expert tensor parallelism (torchtitan's etp = tp): each etp rank holds a slice of every local
            # expert's hidden units (w1's rows, w2's columns); the partial outputs are summed over etp.
            out = _SumOverGroup.apply(self._compute(_CopyToGroup.apply(rows, self.etp_group), ids, mine, w1, w2),
                                      self.etp_group)
        back = all_to_all_single_autograd(out, send_sizes, recv_sizes, group)
        return torch.empty_like(back).index_copy(0, order, back)

    @staticmethod
    def _compute(x, expert, mine, w1, w2):
        # Every local expert runs, on no rows too (as a grouped GEMM does): an expert that receives no token
        # gets a zero gradient, not None, on every rank.
        out = x.new_zeros(x.shape[0], DIM)
        for k, e in enumerate(mine):
            take = (expert == e).nonzero().flatten()
            h = torch.tanh(x[take] @ w1[k].T)
            out = out.index_add(0, take, h @ w2[k].T)
        return out


class _SumOverGroup(torch.autograd.Function):
    """Forward: the partial results summed over the group; backward: the gradient as it is (the same on
    every rank of the group, which all read the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Forward: the input as it is (the same on every rank of the group); backward: the partial gradients
    each rank's slice of the hidden units gives, summed over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's contiguous share of the rows (tensor-parallel ranks hold the same rows);
    backward: every rank's share of the gradient gathered, so the input's gradient is whole everywhere."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size)[me].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's share of the rows gathered (whole on every tensor-parallel rank); backward: the
    gradient, the same on every rank, cut to this rank's share."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        size, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size)[me].contiguous(), None


class MoEBlock(nn.Module):
    """A causal token mix, then top-2 routing over the routed experts plus a shared expert."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.mix = nn.Linear(DIM, DIM, bias=False)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = RoutedExperts(experts)
        self.shared_up = nn.Linear(DIM, SHARED, bias=False)
        self.shared_down = nn.Linear(SHARED, DIM, bias=False)
        self.route_to: int | None = None
        """Every token routed to this expert and the next (an expert that receives none, heavy imbalance)."""
        self.cp_group = None
        """Context parallelism: the ranks holding the other chunks of this rank's sequences, in order."""
        self.routed_off = False
        """Skip the router and the routed experts (the shared expert alone): a step where a framework runs none
        of them, so their gradients are None on every rank."""
        self.tp_group = None
        """Tensor parallelism with the experts on ep (torchtitan's etp = 1, ep borrowing tp): the ranks holding
        the same tokens; each routes its share of them, so every token reaches its experts once."""

    def _prefix(self, x: torch.Tensor) -> tuple[torch.Tensor | float, int]:
        """The sum of the earlier chunks' positions and this chunk's first position (the sequence split over
        ``cp_group`` in rank order): every chunk's sum reaches every rank by an all-to-all with autograd, so
        each chunk's gradient comes back from the ranks whose positions read it."""
        if self.cp_group is None:
            return 0.0, 0
        size, me = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        b, t, d = x.shape
        sums = all_to_all_single_autograd(x.sum(1).repeat(size, 1), [b] * size, [b] * size, self.cp_group)
        return sums.view(size, b, d)[:me].sum(0).unsqueeze(1), me * t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        prefix, first = self._prefix(x)
        steps = torch.arange(first + 1, first + t + 1, dtype=x.dtype, device=x.device).view(1, t, 1)
        x = x + torch.tanh(self.mix((x.cumsum(1) + prefix) / steps))
        flat = x.reshape(-1, d)
        if self.routed_off:
            return x + self.shared_down(torch.tanh(self.shared_up(flat))).view(b, t, d)
        scores = self.router(flat).softmax(-1)
        if self.route_to is None:
            weight, expert = scores.topk(TOP_K, dim=-1)
        else:
            expert = (torch.arange(TOP_K, device=x.device) + self.route_to) % scores.shape[-1]
            expert = expert.expand(flat.shape[0], TOP_K)
            weight = scores.gather(1, expert)
        rows, expert = flat.repeat_interleave(TOP_K, 0), expert.reshape(-1)
        if self.tp_group is None:
            routed = self.experts(rows, expert)
        else:
            share = expert.chunk(dist.get_world_size(self.tp_group))[dist.get_rank(self.tp_group)]
            routed = _GatherRows.apply(self.experts(_TakeRows.apply(rows, self.tp_group), share), self.tp_group)
        mixed = (routed.view(-1, TOP_K, d) * weight.unsqueeze(-1)).sum(1)
        shared = self.shared_down(torch.tanh(self.shared_up(flat)))
        return x + (mixed + shared).view(b, t, d)


class MoENet(nn.Module):
    """Embedding, ``layers`` :class:`MoEBlock`, an RMS norm and the head."""

    def __init__(self, experts: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoEBlock(experts) for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch(step: int, rank: int, world: int, per_rank: int = 2, seq: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (world * per_rank, seq + 1), generator=g)
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor, chunk: int = 0, chunks: int = 1) -> torch.Tensor:
    """Next-token loss over ``tokens``' positions, or over chunk ``chunk`` of ``chunks`` of them (context
    parallelism: the model's blocks see the other chunks through their ``cp_group``)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    length = inputs.shape[1] // chunks
    inputs, targets = (t[:, chunk * length:(chunk + 1) * length] for t in (inputs, targets))
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def stacks(model: MoENet) -> list[str]:
    return [f"layers.{i}.experts.{w}" for i in range(len(model.layers)) for w in ("w1", "w2")]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def reference(initial: dict[str, torch.Tensor], steps: int, world: int, experts: int = 3, layers: int = 2,
              route_to: int | None = None, frozen: tuple[str, ...] = (), clip: float | None = None,
              norms: list | None = None, routed_off_at: int | None = None) -> dict[str, torch.Tensor]:
    """One process from the sharded run's own initial weights (``initial``, full tensors) on the global
    batch: torch.optim.Muon (fp32 NS) on each expert slice and each dense matrix, AdamW on the rest
    (``clip``: torch's ``clip_grad_norm_`` over every gradient first, its norms appended to ``norms``)."""
    model = MoENet(experts, layers)
    model.load_state_dict(initial)
    for block in model.layers:
        block.route_to = route_to
    names = set(stacks(model))
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    slices = [nn.Parameter(params[n].data[e]) for n in sorted(names) if params[n].requires_grad
              for e in range(experts)]
    matrices = [p for n, p in params.items() if p.requires_grad and p.ndim == 2 and n not in names
                and not n.startswith(("embed", "head"))]
    rest = [p for n, p in params.items() if p.requires_grad and (p.ndim < 2 or n.startswith(("embed", "head")))]
    muon = torch.optim.Muon(slices + matrices, **MUON)
    adamw = torch.optim.AdamW(rest, **ADAMW)
    for step in range(steps):
        model.layers[-1].routed_off = step == routed_off_at
        loss_of(model, torch.cat([batch(step, r, world) for r in range(world)])).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            if norms is not None:
                norms.append(float(norm))
        parts = iter(slices)
        for n in sorted(names):
            if params[n].requires_grad:
                for e in range(experts):
                    part = next(parts)
                    part.grad = None if params[n].grad is None else params[n].grad[e].clone()
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        for p in [*slices, *model.parameters()]:
            p.grad = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def expert_parallel(model: MoENet, world_mesh_size: int, ep: int, *, replicate: int = 1,
                    dim1: bool | None = None, force_sum: bool = True, replicate_level: bool = False,
                    tp: int = 1, etp: bool = False):
    """Shards ``model`` as torchtitan does on a ``(replicate x) efsdp x ep`` world of CPU ranks; returns
    ``(dense_mesh, expert_mesh)``, each with its replicate dim first when ``replicate > 1``.

    ``replicate_level``: FSDP2 over the non-replicate dims only (dmuon's replicate level reduces across
    replicas, given both meshes as ``hsdp_mesh``); the experts' gradient is then each replica's mean, divided
    by the replica's data-parallel size.

    ``tp``: the shared expert tensor-parallel (colwise, rowwise) over a ``tp`` dim after ``fsdp``, and ``ep``
    borrowing those ranks (torchtitan's ``etp = 1``: ``ep == tp`` here); the dense parameters on
    ``(fsdp, tp)``, the experts on ``(efsdp, ep)``, the experts' gradient the mean over the data ranks.
    ``etp``: the experts tensor-parallel too (torchtitan's ``etp = tp``), ``ep`` borrowing data ranks: the
    stacks on ``(efsdp, ep, etp)``, ``Shard(0)`` on ep and each expert's hidden units split over etp.

    ``dim1``: FSDP2 shards the local stacks on dim 1 (torchtitan's choice when ``efsdp * ep > E``;
    None: by that rule). The experts' gradient is divided by the whole data-parallel size
    (``set_gradient_divide_factor``); on gloo, which refuses ``PREMUL_SUM``, as a sum then a division
    (``set_force_sum_reduction_for_comms``), except with ``efsdp == 1``, where torch 2.13's FSDP2 would
    divide twice (its one-rank copy divides, then the sum's division again; across HSDP replicas too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = world_mesh_size // replicate
    efsdp = data // ep
    world = init_device_mesh("cpu", (world_mesh_size,), mesh_dim_names=("world",))
    if replicate > 1:
        dense = world._unflatten(0, (replicate, data), ("dp_replicate", "fsdp"))
        experts = world._unflatten(0, (replicate, efsdp, ep), ("dp_replicate", "efsdp", "ep"))
        edp = experts["efsdp"] if replicate_level else experts["dp_replicate", "efsdp"]
    elif tp > 1 and etp:
        assert replicate == 1 and (data // tp) % ep == 0, "ep borrows data ranks"
        dense = world._unflatten(0, (data // tp, tp), ("fsdp", "tp"))
        efsdp = data // tp // ep
        experts = world._unflatten(0, (efsdp, ep, tp), ("efsdp", "ep", "etp"))
        edp = experts["efsdp"]
    elif tp > 1:
        assert ep == tp and replicate == 1, "ep borrows the tp ranks"
        dense = world._unflatten(0, (data // tp, tp), ("fsdp", "tp"))
        experts = world._unflatten(0, (efsdp, ep), ("efsdp", "ep"))
        edp = experts["efsdp"]
    else:
        dense = world._unflatten(0, (data,), ("fsdp",))
        experts = world._unflatten(0, (efsdp, ep), ("efsdp", "ep"))
        edp = experts["efsdp"]
    dense_shard = dense["fsdp"] if replicate_level or tp > 1 else dense
    divide = data if replicate_level else world_mesh_size // tp
    count = model.layers[0].experts.num_experts
    if dim1 is None:
        dim1 = efsdp * ep > count
    for block in model.layers:
        if tp > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(block, dense["tp"], {"shared_up": ColwiseParallel(), "shared_down": RowwiseParallel()})
            block.tp_group = None if etp else dense["tp"].get_group()
        routed = block.experts
        for w, hidden in (("w1", 1), ("w2", 2)):
            mesh, placements = (experts["ep", "etp"], [Shard(0), Shard(hidden)]) if etp else (experts["ep"], [Shard(0)])
            setattr(routed, w, nn.Parameter(distribute_tensor(getattr(routed, w).data, mesh, placements)))
        fully_shard(routed, mesh=edp, shard_placement_fn=(lambda p: Shard(1)) if dim1 else None)
        routed.set_gradient_divide_factor(float(divide))
        if force_sum and efsdp > 1:  # with one efsdp rank torch 2.13's FSDP2 would divide twice (the review's note)
            routed.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense_shard)
    fully_shard(model, mesh=dense_shard)
    return dense, experts


class Layout(NamedTuple):
    world: int
    ep: int
    experts: int
    dim1: bool | None = None
    """FSDP2 on the local stacks' dim 1 (None: torchtitan's rule, when ``efsdp * ep > E``)."""
    replicate: int = 1
    """``dp_replicate`` outside (HSDP)."""
    replicate_level: bool = False
    """Across replicas dmuon reduces (``hsdp_mesh``), not FSDP2."""
    cp: int = 1
    """Context parallelism folded into the dense shard dim (torchtitan's ``dp_shard_cp``): each sequence split
    over ``cp`` ranks, ``ep`` borrowing them."""
    tp: int = 1
    """Tensor parallelism on the dense parameters, ``ep`` borrowing the tp ranks (torchtitan's ``etp = 1``)."""
    etp: bool = False
    """The experts tensor-parallel over the tp ranks too (torchtitan's ``etp = tp``), ``ep`` borrowing data ranks."""


LAYOUTS = {
    "ep2-dim1": Layout(4, 2, 3),  # efsdp * ep = 4 > E = 3: FSDP2 on the local stacks' dim 1
    "ep2-dim0-uneven": Layout(4, 2, 3, dim1=False),  # E = 3 over ep = 2 (2 + 1 experts), FSDP2 on dim 0
    "ep2-dim0": Layout(4, 2, 4),  # E = 4 = efsdp * ep: FSDP2 on dim 0
    "ep2-native-hsdp": Layout(4, 2, 3, replicate=2),  # dp_replicate = 2 outside (FSDP2's own HSDP), efsdp = 1
    "ep2-replicate-level": Layout(4, 2, 3, replicate=2, replicate_level=True),  # the same, reduced by dmuon
    "cp2-ep2": Layout(4, 2, 3, cp=2),  # two data ranks x two sequence chunks, dense over all four, ep = cp
    "tp2-ep2": Layout(4, 2, 3, tp=2),  # two data ranks x tp 2 on the shared expert, ep = tp
    "tp2-ep2-etp2": Layout(4, 2, 3, tp=2, etp=True),  # two data ranks (ep over them) x tp 2, experts split by tp
    "ep2-efsdp1": Layout(2, 2, 3),  # ep spans the whole fsdp dim
}


def train(rank: int, world: int, layout: str, steps: int = 3, *, route_to: int | None = None,
          clip: float | None = None, frozen: tuple[str, ...] = (), counted: bool = False,
          execution=None, routed_off_at: int | None = None) -> dict:
    """Trains :class:`MoENet` laid out as ``LAYOUTS[layout]`` with DMuon (fp32 NS; ``counted``: bf16 wire
    and the last step's counted collectives) for ``steps`` steps, every rank reading its own batch.

    ``clip``: ``opt.clip_grad_norm_`` before each step (the whole model's norm across the dense and
    expert meshes). Returns the initial and final full parameters, the plan's owners and pieces, each
    stack's local momentum size, and the step's figures."""
    import dmuon

    size, ep, experts, dim1, replicate, level, cp, tp, etp = LAYOUTS[layout]
    assert size == world, (layout, world)
    torch.manual_seed(0)
    model = MoENet(experts)
    for block in model.layers:
        block.route_to = route_to
    dense, expert_mesh = expert_parallel(model, world, ep, replicate=replicate, dim1=dim1, replicate_level=level,
                                         tp=tp, etp=etp)
    data_rank, chunk = divmod(dist.get_rank() // tp, cp)  # a data rank's tp ranks read its batch alike
    if cp > 1:
        # The cp ranks of one sequence are consecutive, the ep groups' ranks (ep borrows cp).
        cp_group = expert_mesh["ep"].get_group()
        assert dist.get_world_size(cp_group) == cp
        for block in model.layers:
            block.cp_group = cp_group
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    initial = full_state(model)
    ns_dtype = torch.bfloat16 if counted else torch.float32
    opt = dmuon.DMuon(model, lr=MUON["lr"], weight_decay=MUON["weight_decay"],
                      ns=dmuon.NSConfig(method="standard", dtype=ns_dtype), adamw=dict(ADAMW),
                      execution=execution or dmuon.ExecutionConfig(),
                      hsdp_mesh=(dense, expert_mesh) if level else None)
    norms = []
    for step in range(steps):
        model.layers[-1].routed_off = step == routed_off_at
        loss_of(model, batch(step, data_rank, world // (cp * tp)), chunk, cp).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    opt.flush_updates()
    stats = opt.last_step_stats()
    plan = opt.plan
    named = dict(model.named_parameters())
    out = {"initial": initial, "params": full_state(model), "norms": norms,
           "owners": {i.name: i.owner for i in plan.infos}, "plan_rank": opt.runtime.topo.rank,
           "orthogonalized": stats["orthogonalized"], "collectives": stats["collectives"],
           "blocks_in_backward": stats["blocks_exchanged_in_backward"], "blocks": len(plan.blocks),
           "momentum_numel": {n: opt.state[named[n]]["momentum_buffer"].to_local().numel()
                              for n in stacks(model) if named[n].requires_grad},
           "loads": list(plan.balance_result.loads)}
    if counted:
        matrices = {id(i.param) for i in plan.infos}
        # With dmuon's replicate level: per FSDP2 group, this rank's bytes of the other parameters' gradient
        # shards (float32), which dmuon all-reduces across replicas.
        out["other_bytes"] = [sum(p.to_local().numel() * 4 for p in g.params if id(p) not in matrices)
                              for g in plan.groups] if plan.replicate_level else []
        out.update(log=list(opt.runtime.stats.last_log), waves=stats["return_waves"],
                   infos=[(tuple(i.shape), i.owner, i.block) for i in plan.infos],
                   pieces=[i.pieces for i in plan.infos], replicate=plan.replicate, shard=plan.shard)
    return out


def refused(rank: int, world: int, kind: str) -> str:
    """The error DMuon raises on this rank for a layout it must refuse (``""``: none raised).

    ``"two roots"``: the experts on a mesh of their own ``init_device_mesh``, not cut from the dense
    parameters' root; ``"ep along rows"``: the stacks split over ep by their rows, not by expert;
    ``"rows claimed twice"``: a dense matrix whose last rank holds a row more than its placement gives it
    (past the matrix's end)."""
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MoENet(4, layers=1)
    if kind == "two roots":
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        experts = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
        placement = Shard(0)
    else:
        world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
        dense = world_mesh._unflatten(0, (world,), ("fsdp",))
        experts = world_mesh._unflatten(0, (1, world), ("efsdp", "ep"))
        placement = Shard(1) if kind == "ep along rows" else Shard(0)
    routed = model.layers[0].experts
    for w in ("w1", "w2"):
        setattr(routed, w, nn.Parameter(distribute_tensor(getattr(routed, w).data, experts["ep"], [placement])))
    fully_shard(routed, mesh=experts["efsdp"])
    fully_shard(model, mesh=dense)
    if kind == "rows claimed twice":
        mix = model.layers[0].mix
        rows = -(-DIM // world) + (dist.get_rank() == world - 1)
        local = torch.zeros(rows, DIM)  # the last rank one row more than its placement gives: past the end
        mix.weight = nn.Parameter(DTensor.from_local(local, dense, [Shard(0)], run_check=False, shape=(DIM, DIM),
                                                     stride=(DIM, 1)))
    try:
        dmuon.DMuon(model, lr=0.02)
    except ValueError as exc:
        return str(exc)
    return ""
