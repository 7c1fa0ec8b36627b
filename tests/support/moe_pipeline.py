"""The Mixture-of-Experts model of :mod:`support.moe` in pipeline stages, laid out as torchtitan lays it out.

torchtitan's ``ParallelDims`` unflattens one 1-D world mesh twice: ``("pp", "fsdp")`` for the dense
parameters and ``("pp", "efsdp", "ep")`` for the routed experts (``efsdp * ep == fsdp``: ep borrows the
stage's data-parallel ranks, each of which reads its own micro-batches). Each pipeline stage holds a run of
MoE blocks (the first stage the embedding, the last the norm and head): its dense parameters are
``fully_shard``-ed over the stage's ``fsdp`` ranks, its expert stacks split ``Shard(0)`` over the stage's
``ep`` ranks (tokens reach them by all-to-all inside that group only) and ``fully_shard``-ed over the
stage's ``efsdp`` ranks, with the gradient divided by the stage's whole data-parallel size. A schedule
of torch.distributed.pipelining runs forward and backward; one DMuon per rank's parts, with ``pp_group``.

The reference is :func:`support.moe.reference`: one process, the whole model on the global batch, from the
sharded stages' own initial full weights, torch.optim.Muon per expert slice and dense matrix + AdamW.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from support import moe
from support import pipeline
from support.pipeline import MULTI, SINGLE, stages_of


class PipeMoE(moe.MoENet):
    """:class:`support.moe.MoENet` whose parts can drop what other stages hold: the layers keyed by their
    index (``layers.1.mix.weight`` on any stage, the reference's names), the embedding, norm and head
    ``None`` where another stage holds them."""

    def __init__(self, experts: int, layers: int) -> None:
        super().__init__(experts, layers)
        self.layers = nn.ModuleDict({str(k): block for k, block in enumerate(self.layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pipeline.stage_forward(self, x)


def part_of(model: PipeMoE, stage: int, stages: int) -> PipeMoE:
    """Stage ``stage`` of ``stages``: a copy of ``model`` keeping an even run of its layers (the pipeline
    tests' cut: the first stage the embedding, the last the norm and head)."""
    return pipeline.part_of(model, stage, stages, split=(len(model.layers) // stages,) * stages)


def meshes(world_size: int, pp: int, ep: int, replicate: int = 1):
    """torchtitan's meshes: ``(dense, experts)`` unflattened from one 1-D world mesh as ``(pp, fsdp)`` and
    ``(pp, efsdp, ep)``, with ``dp_replicate`` after ``pp`` when ``replicate > 1``."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = world_size // pp // replicate
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    outer, names = ((pp, replicate), ("pp", "dp_replicate")) if replicate > 1 else ((pp,), ("pp",))
    dense = world._unflatten(0, (*outer, dp), (*names, "fsdp"))
    experts = world._unflatten(0, (*outer, dp // ep, ep), (*names, "efsdp", "ep"))
    return dense, experts


def data_dims(dense, experts, level: bool = False):
    """This stage's meshes the way FSDP2 takes them, ``(dense, experts)``: the data-parallel dims
    (``dp_replicate`` too when there is one, FSDP2's own HSDP); ``level``: the non-replicate dims only (dmuon's
    replicate level reduces across the replicas)."""
    if "dp_replicate" in dense.mesh_dim_names and not level:
        return dense["dp_replicate", "fsdp"], experts["dp_replicate", "efsdp"]
    return dense["fsdp"], experts["efsdp"]


def shard_stage(part: PipeMoE, dense, experts, reshard: bool = False, level: bool = False) -> None:
    """One stage's part laid out as torchtitan's ``apply_fsdp`` + ``ExpertParallel`` do, on the stage's own
    meshes (:func:`data_dims`, ``experts["ep"]``: the rows of the ``pp`` dim this rank is on). ``reshard``:
    ``reshard_after_forward`` (False is torchtitan's default under pipelining: every micro-batch's forward
    would all-gather again). ``level``: FSDP2 over the non-replicate dims (:func:`data_dims`)."""
    from torch.distributed.fsdp import fully_shard

    fsdp, edp = data_dims(dense, experts, level)
    ep = experts["ep"]
    # torchtitan's rule: FSDP2 shards the local stacks on dim 1 when efsdp * ep exceeds the experts.
    dim1 = experts["efsdp"].size() * ep.size() > part.layers[next(iter(part.layers))].experts.num_experts
    for block in part.layers.values():
        routed = block.experts
        for w in ("w1", "w2"):
            setattr(routed, w, nn.Parameter(distribute_tensor(getattr(routed, w).data, ep, [Shard(0)])))
        fully_shard(routed, mesh=edp, reshard_after_forward=reshard,
                    shard_placement_fn=(lambda p: Shard(1)) if dim1 else None)
        # The experts' gradient is the mean over every data rank FSDP2 reduces over (torchtitan's
        # gradient_divide_factor). On gloo, which refuses PREMUL_SUM, as a sum then a division, but for a
        # single rank: there torch 2.13's FSDP2 would divide twice.
        routed.set_gradient_divide_factor(float(fsdp.size()))
        if edp.size() > 1:
            routed.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=fsdp, reshard_after_forward=reshard)
    fully_shard(part, mesh=fsdp, reshard_after_forward=reshard)


def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, moe.VOCAB), targets.reshape(-1))


def reference_world(dp: int, microbatches: int) -> int:
    """The ``world`` :func:`support.moe.reference` takes for ``dp`` data ranks of ``microbatches`` samples
    each: it reads ``world`` ranks of 2 samples from the same generated global batch."""
    assert (dp * microbatches) % 2 == 0
    return dp * microbatches // 2


def torchtitan_clip(params: list[torch.Tensor], max_norm: float, pp_group) -> float:
    """torchtitan's ``clip_grad_norm_(..., ep_enabled=True, pp_mesh=)`` (``_clip_grad_norm_with_ep``): torch's
    ``get_total_norm`` over the expert gradients and over the others apart (their DTensors live on different
    meshes), each made whole over its mesh, combined, the squares summed over the pipeline stages; then
    ``clip_grads_with_norm_`` on both sets."""
    ep_params, other = [], []
    for p in params:
        if p.grad is None:
            continue
        (ep_params if "ep" in (p.device_mesh.mesh_dim_names or ()) else other).append(p)

    def norm_of(group):
        if not group:
            return torch.zeros(())
        total = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        return total.full_tensor() if isinstance(total, DTensor) else total

    squared = norm_of(ep_params) ** 2 + norm_of(other) ** 2
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    total = squared ** 0.5
    torch.nn.utils.clip_grads_with_norm_(ep_params, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(other, max_norm, total)
    return total.item()


@contextmanager
def token_groups(seen: list):
    """Records the ranks of the group every token all-to-all of :class:`support.moe.RoutedExperts` runs on
    (its forward's; the backward's runs on the same group), appended to ``seen``."""
    send = moe.all_to_all_single_autograd

    def recorded(rows, output_sizes, input_sizes, group):
        seen.append(tuple(dist.get_process_group_ranks(group)))
        return send(rows, output_sizes, input_sizes, group)

    with mock.patch.object(moe, "all_to_all_single_autograd", recorded):
        yield


def _states(parts: list[PipeMoE], opt, indices: list[int]) -> dict:
    """Each part's model and optimizer state dicts, as torchtitan takes them (``get_state_dict`` per part)."""
    assert len(parts) == 1, "one part per rank: its DMuon steps it alone"
    return {f"part{index}": dict(zip(("model", "optim"), get_state_dict(part, opt)))
            for index, part in zip(indices, parts)}


def train(rank: int, world_size: int, schedule: str, *, steps: int = 3, pp: int = 2, ep: int = 2,
          experts: int = 3, microbatches: int = 4, clip: float | None = None, clip_with: str = "dmuon",
          route_to: int | None = None, reshard: bool = False, nonfinite: str | None = None,
          poison: tuple[int, int] | None = None, replicate: int = 1, level: bool = False,
          built_before_sharding: bool = False, save_to: tuple[str, int] | None = None,
          resume_from: tuple[str, int] | None = None) -> dict:
    """Trains :class:`PipeMoE` on ``pp`` stages (per rank one stage, or two under a multi-stage schedule: then
    twice the layers) with DMuon (fp32 NS), every data rank reading its own ``microbatches`` samples.

    ``clip``: clipping by the whole model's norm before each step, by the DMuon's ``clip_grad_norm_``
    (``clip_with="dmuon"``) or by :func:`torchtitan_clip` (``"torchtitan"``). ``route_to``: every token
    routed to that expert and the next (:attr:`support.moe.MoEBlock.route_to`). ``reshard``: ZeRO-3
    (``reshard_after_forward``). ``nonfinite``: DMuon's; ``poison=(step, stage)`` puts a NaN in that stage's
    first expert gradient (this rank's shard of it) at that step. ``replicate``: a ``dp_replicate`` dim
    outside each stage's ``fsdp``, FSDP2's own HSDP, or ``level``: dmuon's replicate level (``hsdp_mesh``:
    the stage's dense and expert views with their replicate dim). ``built_before_sharding``: the DMuon built
    on the plain parts (a framework's order), before ExpertParallel and FSDP2 swap their parameters; it sets
    itself up at the first forward (the schedule's shape inference). ``save_to=(path, k)``: after ``k`` steps,
    every stage's part saves its model and optimizer state dicts (torch's ``get_state_dict`` per part) in
    one DCP checkpoint; ``resume_from=(path, k)``: the fresh parts load it and train steps ``k`` on.

    Returns this rank's parts' initial and final full parameters (by name), the clipping norms, per step the
    matrices this rank orthogonalized and whether the step was skipped, its stage indices, the model's
    layers, the ranks of its pipeline stage, of its ep group and of every group its token all-to-alls ran on, the plan's
    owners (ranks of the stage's mesh) and this rank's, each expert stack's local momentum size, and the
    last step's counted collectives with the plan's matrices."""
    import dmuon
    from torch.distributed import pipelining

    dense, expert_mesh = meshes(world_size, pp, ep, replicate)
    dp = world_size // pp  # the stage's data ranks, each reading its own micro-batches
    dp_rank = dense.get_local_rank("fsdp")
    if replicate > 1:
        dp_rank += dense.get_local_rank("dp_replicate") * dense["fsdp"].size()
    indices, n_stages = stages_of(schedule, dense.get_local_rank("pp"), pp)
    torch.manual_seed(0)
    whole = PipeMoE(experts, layers=n_stages)  # one MoE block per stage
    for block in whole.layers.values():
        block.route_to = route_to
    parts = [part_of(whole, index, n_stages) for index in indices]

    def optimizer():
        return dmuon.DMuon(parts[0] if len(parts) == 1 else nn.ModuleList(parts), lr=moe.MUON["lr"],
                           weight_decay=moe.MUON["weight_decay"],
                           ns=dmuon.NSConfig(method="standard", dtype=torch.float32), adamw=dict(moe.ADAMW),
                           pp_group=dense["pp"], execution=dmuon.ExecutionConfig(nonfinite=nonfinite),
                           hsdp_mesh=(dense["dp_replicate", "fsdp"], expert_mesh["dp_replicate", "efsdp", "ep"])
                           if level else None)

    opt = optimizer() if built_before_sharding else None
    stages = []
    for index, part in zip(indices, parts):
        shard_stage(part, dense, expert_mesh, reshard, level)
        stages.append(pipelining.PipelineStage(part, index, n_stages, torch.device("cpu"),
                                               group=dense["pp"].get_group()))
    initial = {n: p for part in parts for n, p in moe.full_state(part).items()}
    opt = opt or optimizer()
    kind = getattr(pipelining, SINGLE.get(schedule) or MULTI[schedule])
    # scale_grads: the schedule divides by the micro-batches, FSDP2 by the data ranks: the global batch's mean.
    pipe = kind(stages[0] if schedule in SINGLE else stages, microbatches, loss_fn=ce, scale_grads=True)
    norms, orthogonalized, seen, skipped = [], [], [], []
    if resume_from is not None:
        states = _states(parts, opt, indices)
        dcp.load(states, checkpoint_id=resume_from[0])
        for index, part in zip(indices, parts):
            set_state_dict(part, opt, model_state_dict=states[f"part{index}"]["model"],
                           optim_state_dict=states[f"part{index}"]["optim"])
    for step in range(resume_from[1] if resume_from else 0, steps):
        if save_to is not None and step == save_to[1]:
            dcp.save(_states(parts, opt, indices), checkpoint_id=save_to[0])
        tokens = moe.batch(step, dp_rank, dp, per_rank=microbatches)  # this data rank's own samples
        args = (tokens[:, :-1],) if 0 in indices else ()
        kwargs = {"target": tokens[:, 1:]} if n_stages - 1 in indices else {}
        with token_groups(seen):
            pipe.step(*args, **kwargs)
        if poison is not None and poison[0] == step and poison[1] in indices:
            part = parts[indices.index(poison[1])]
            first = next(p for n, p in part.named_parameters() if ".experts." in n and p.grad is not None)
            first.grad.to_local().view(-1)[0] = float("nan")
        if clip is not None and clip_with == "dmuon":
            norms.append(opt.clip_grad_norm_(clip).item())
        elif clip is not None:
            norms.append(torchtitan_clip([p for part in parts for p in part.parameters()], clip,
                                         dense["pp"].get_group()))
        opt.step()
        opt.zero_grad()
        stats = opt.last_step_stats()
        orthogonalized.append(stats["orthogonalized"])
        skipped.append(opt.last_step_report().skipped_nonfinite)
    final = {n: p for part in parts for n, p in moe.full_state(part).items()}
    named = {n: p for part in parts for n, p in part.named_parameters()}
    momentum = {n: opt.state[p]["momentum_buffer"].to_local().numel() for n, p in named.items()
                if ".experts." in n and "momentum_buffer" in opt.state.get(p, {})}
    return {"initial": initial, "params": final, "norms": norms, "orthogonalized": orthogonalized,
            "stages": indices, "layers": n_stages, "stage_ranks": tuple(sorted(
                (dense["dp_replicate", "fsdp"] if replicate > 1 else dense["fsdp"]).mesh.flatten().tolist())),
            "ep_ranks": tuple(dist.get_process_group_ranks(expert_mesh["ep"].get_group())),
            "token_groups": sorted(set(seen)), "token_all_to_alls": len(seen), "skipped": skipped,
            "owners": {i.name: i.owner for i in opt.plan.infos}, "plan_rank": opt.runtime.topo.rank,
            "momentum_numel": momentum,
            # What the runtime counted in the last step (its launches from the schedule's reduction
            # included), and the plan: the step model's collectives for this stage's matrices.
            "counted": {"log": list(opt.runtime.stats.last_log), "waves": stats["return_waves"],
                        "shard": opt.plan.topology.shard, "pieces": [i.pieces for i in opt.plan.infos],
                        "infos": [(tuple(i.shape), i.owner, i.block) for i in opt.plan.infos]}}
