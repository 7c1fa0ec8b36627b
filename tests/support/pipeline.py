"""Pipeline-parallel training with torch.distributed.pipelining: one DMuon per model part, each part
``fully_shard``-ed over its stage's data-parallel ranks, against one process training the whole model.

The model keeps torchtitan's layout for its parts: every part is the whole model with the layers of
other stages removed (``None``), so each parameter keeps its name (``layers.3.up.weight``) and the
single-process reference selects the same matrices.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.bench.op_count import HostReadCounter
from dmuon.comm.device_streams import active as active_streams

from support.cases import MUON_KW
from support.models import OddBlock
from support.reference import reference_training

VOCAB, DIM, LAYERS = 50, 37, 4
SEQ, MICROBATCH = 5, 1
ADAMW_LR = 3e-3
STEPS = 3


class PipeNet(nn.Module):
    """An embedding, odd-shaped blocks, a norm and a head: a part holds a contiguous run of them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(k): OddBlock(DIM) for k in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self, x)


def stage_forward(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A stage's forward: its embedding (the first stage), its layers in order, its norm and head (the last);
    :func:`part_of` leaves the others None."""
    if part.embed is not None:
        x = part.embed(x)
    for layer in part.layers.values():
        x = layer(x)
    if part.head is not None:
        x = part.head(part.norm(x))
    return x


def part_of(model: PipeNet, stage: int, stages: int, split: tuple[int, ...] | None = None) -> PipeNet:
    """Stage ``stage`` of ``stages``: a copy of ``model`` keeping its run of layers (the first stage
    the embedding, the last the norm and head); ``split``: the layers per stage (None: even)."""
    part = copy.deepcopy(model)
    split = split or (LAYERS // stages,) * stages
    first = sum(split[:stage])
    keep = {str(k) for k in range(first, first + split[stage])}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.embed = None
    if stage != stages - 1:
        part.norm = None
        part.head = None
    return part


def global_batch(step: int, dp: int, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every data-parallel rank's samples of ``step``, rank after rank."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (dp * microbatches * MICROBATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def reference(dp: int, microbatches: int, steps: int = STEPS, clip: float | None = None,
              skipped: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """One process training the whole model on every rank's samples with torch.optim.Muon + AdamW
    (fp32 NS): the parameters after ``steps`` (``skipped``: steps it leaves out, as a skipped step
    changes nothing). The clipping norms are left in ``reference.norms``."""
    torch.manual_seed(0)
    model = PipeNet()
    batches = [global_batch(step, dp, microbatches) for step in range(steps) if step not in skipped]
    params, _ = reference_training(model, batches, lambda m, b: _ce(m(b[0]), b[1]), muon_kwargs=MUON_KW,
                                   adamw_kwargs=dict(lr=ADAMW_LR, weight_decay=0.01), ns_dtype=torch.float32,
                                   clip=clip)
    reference.norms = list(reference_training.norms)
    return params


SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
MULTI = {"interleaved1f1b": "ScheduleInterleaved1F1B", "loopedbfs": "ScheduleLoopedBFS",
         "zbv": "ScheduleZBVZeroBubble", "interleavedzb": "ScheduleInterleavedZeroBubble"}


def stages_of(schedule: str, pp_rank: int, pp: int) -> tuple[list[int], int]:
    """The stage indices this pipeline rank holds under ``schedule``, and the number of stages."""
    if schedule in SINGLE:
        return [pp_rank], pp
    if schedule == "zbv":  # V-shaped: rank r holds stages r and 2 pp - 1 - r
        return [pp_rank, 2 * pp - 1 - pp_rank], 2 * pp
    return [pp_rank, pp_rank + pp], 2 * pp


@dataclass
class Pipeline:
    """One rank's side of a pipeline-parallel training run (:func:`build`)."""

    world: object
    parts: list[PipeNet]
    stage_indices: list[int]
    stages_total: int
    optimizers: list
    schedule: object
    dp: int
    dp_rank: int
    microbatches: int

    def step(self, step: int) -> None:
        """The schedule's forward and backward on this rank's share of ``step``'s global batch."""
        tokens, targets = global_batch(step, self.dp, self.microbatches)
        per = self.microbatches * MICROBATCH
        mine = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        args = (tokens[mine],) if 0 in self.stage_indices else ()
        kwargs = {"target": targets[mine]} if self.stages_total - 1 in self.stage_indices else {}
        self.schedule.step(*args, **kwargs)

    def optimize(self) -> None:
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad()

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank's parts, whole (a collective over each stage's mesh)."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for part in self.parts for name, p in part.named_parameters()}


def _without_messages_to_itself(stage):
    """``stage``, able to start a V-shaped schedule (ZBV) on gloo under torch 2.11 too.

    torch 2.11's schedules open each stage's links by sending a dummy tensor to the neighbouring stages'
    ranks (``_get_init_p2p_neighbors_ops``), the V's turn included, whose two stages sit on the same rank;
    gloo has no pair from a rank to itself and raises ("Pair is not connected") on that rank while the
    others wait. Those messages to itself carry nothing the schedule reads (activations between the turn's
    stages pass on the rank), so they are dropped here; torch 2.12+ opens the links otherwise and sends none.
    """
    opener = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if opener is None:
        return stage
    me = dist.get_rank(stage.group)

    def links_to_others():
        return [op for op in opener() if op.group_peer != me]

    stage._get_init_p2p_neighbors_ops = links_to_others
    return stage


def build(rank: int, world_size: int, schedule: str, *, pp: int = 2, microbatches: int = 4,
          scale_grads: bool = True, zero: int = 2, hsdp: str | None = None, pp_group: bool = False,
          nonfinite: str | None = None, one_optimizer: bool = False, split: tuple[int, ...] | None = None,
          built_before_sharding: bool = False) -> Pipeline:
    """:class:`PipeNet` on a ``(pp, dp)`` mesh (``hsdp``: ``(pp, replicate, shard)`` with two replicas,
    ``"fsdp2"`` FSDP2's own HSDP, ``"dmuon"`` dmuon's replicate level), each part ``fully_shard``-ed over
    its stage's data-parallel ranks, one DMuon per part (``one_optimizer``, or a pipeline group with
    several parts per rank: one over the rank's parts), the schedule torch ships."""
    from torch.distributed import pipelining

    dp = world_size // pp
    if hsdp is None:
        world = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        shard_mesh, hsdp_mesh = world["dp"], None
        dp_rank = world.get_local_rank("dp")
    else:
        world = init_device_mesh("cpu", (pp, 2, dp // 2), mesh_dim_names=("pp", "replicate", "shard"))
        if hsdp == "fsdp2":
            shard_mesh, hsdp_mesh = world["replicate", "shard"], None
        else:
            shard_mesh, hsdp_mesh = world["shard"], world["replicate", "shard"]
        dp_rank = world.get_local_rank("replicate") * (dp // 2) + world.get_local_rank("shard")
    torch.manual_seed(0)
    whole = PipeNet()
    indices, n_stages = stages_of(schedule, world.get_local_rank("pp"), pp)
    parts = [part_of(whole, index, n_stages, split) for index in indices]
    settings = dict(MUON_KW, adamw=dmuon.AdamWConfig(lr=ADAMW_LR),
                    ns=dmuon.NSConfig(dtype=torch.float32, method="standard"), hsdp_mesh=hsdp_mesh,
                    pp_group=world["pp"] if pp_group else None, execution=dmuon.ExecutionConfig(nonfinite=nonfinite))

    def optimizers_of(parts):
        if one_optimizer or (len(parts) > 1 and pp_group):
            return [dmuon.DMuon(nn.ModuleList(parts), **settings)]
        return [dmuon.DMuon(part, **settings) for part in parts]

    # Built before sharding (a framework's order), DMuon sets itself up at the first forward.
    optimizers = optimizers_of(parts) if built_before_sharding else None
    stages = []
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for index, part in zip(indices, parts):
        for layer in part.layers.values():
            fully_shard(layer, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=zero == 3)
        fully_shard(part, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=zero == 3)
        stages.append(_without_messages_to_itself(pipelining.PipelineStage(part, index, n_stages, torch.device("cpu"),
                                                                           group=world.get_group("pp"))))
    optimizers = optimizers or optimizers_of(parts)
    divide = 1 if scale_grads else microbatches

    def loss_fn(logits, targets):
        return _ce(logits, targets) / divide

    kind = getattr(pipelining, SINGLE.get(schedule) or MULTI[schedule])
    pipe = kind(stages[0] if schedule in SINGLE else stages, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return Pipeline(world, parts, indices, n_stages, optimizers, pipe, dp, dp_rank, microbatches)


def train(rank: int, world_size: int, schedule: str, *, steps: int = STEPS, clip: float | None = None,
          clip_with: str = "dmuon", nonfinite: str | None = None, poison: tuple[int, int] | None = None,
          **options) -> dict:
    """Trains a :func:`build` pipeline (``options``: its keywords) ``steps`` steps.

    ``clip``: clipping by the whole model's norm, through each DMuon's ``clip_grad_norm_`` (``clip_with=
    "dmuon"``, ``pp_group`` given) or torch's as torchtitan calls it (``"torch"``: each rank's local norm
    over its parts, the total all-reduced over the pp group, ``clip_grads_with_norm_``). ``nonfinite``:
    DMuon's, with ``pp_group``; ``poison=(step, stage)`` puts a NaN in that stage's first gradient at
    that step.

    Returns, on each rank, every parameter of its parts whole (by name), the steps' reports and the
    clipping norms.
    """
    run = build(rank, world_size, schedule, nonfinite=nonfinite,
                pp_group=(clip is not None and clip_with == "dmuon") or nonfinite is not None, **options)
    reports, norms, reads, joins = [], [], [], []
    streams = active_streams()
    for step in range(steps):
        # How often the schedule's step made the compute stream wait for dmuon's (the stream checker's count).
        waits = getattr(streams, "waits", None)
        before = waits[("compute", "dmuon")] if waits is not None else 0
        run.step(step)
        joins.append(waits[("compute", "dmuon")] - before if waits is not None else None)
        if poison is not None and poison[0] == step and poison[1] in run.stage_indices:
            first = next(p for p in run.parts[run.stage_indices.index(poison[1])].parameters() if p.grad is not None)
            first.grad.to_local().view(-1)[0] = float("nan")
        if clip is not None and clip_with != "dmuon":  # uncounted below: torch's clip reads its norm itself
            norms.append(_torchtitan_clip([p for part in run.parts for p in part.parameters()], clip,
                                          run.world["pp"]))
        # The host reads of DMuon's clip and the step (torch.optim's AdamW step counters live on the host).
        counter = HostReadCounter(s["step"] for opt in run.optimizers for s in opt.state.values()
                                  if isinstance(s.get("step"), torch.Tensor))
        with counter:
            if clip is not None and clip_with == "dmuon":
                step_norms = [opt.clip_grad_norm_(clip) for opt in run.optimizers]
            run.optimize()
        reads.append(counter.count)
        if clip is not None and clip_with == "dmuon":
            norms.append([n.item() for n in step_norms])
        reports.append([opt.last_step_report() for opt in run.optimizers])
    # What each optimizer's runtime counted in the last step (its launches from the reduction included),
    # and its plan: for the step model's collectives.
    counted = [{"log": list(opt.runtime.stats.last_log), "plan_rank": opt.runtime.topo.rank,
                "waves": opt.last_step_stats()["return_waves"], "shard": opt.plan.topology.shard,
                "infos": [(tuple(i.shape), i.owner, i.block) for i in opt.plan.infos]} for opt in run.optimizers]
    return {"params": run.params(), "reports": reports, "norms": norms, "counted": counted, "reads": reads,
            "joins": joins, "stages": len(run.stage_indices)}


def _state(run: Pipeline) -> list[dict]:
    """Each part's model and optimizer state dicts, as torchtitan takes them (``get_state_dict`` per part)."""
    return [dict(zip(("model", "optim"), get_state_dict(part, opt)))
            for part, opt in zip(run.parts, run.optimizers)]


def save_and_go_on(rank: int, world_size: int, path: str, saved_at: int, more: int, **options) -> dict:
    """Trains ``saved_at`` steps, saves one DCP checkpoint for every stage, then trains ``more`` steps on;
    then a fresh pipeline of the same layout resumes from the checkpoint and trains the same steps.
    Returns both runs' parameters on each rank."""
    run = build(rank, world_size, "1f1b", **options)
    for step in range(saved_at):
        run.step(step)
        run.optimize()
    dcp.save({f"part{i}": s for i, s in zip(run.stage_indices, _state(run))}, checkpoint_id=path)
    for step in range(saved_at, saved_at + more):
        run.step(step)
        run.optimize()
    went_on = run.params()
    return {"went_on": went_on, "resumed": resume(rank, world_size, path, saved_at, more, **options)}


def resume(rank: int, world_size: int, path: str, saved_at: int, more: int, **options) -> dict[str, torch.Tensor]:
    """A fresh pipeline (of any data-parallel size) loads the checkpoint and trains ``more`` steps."""
    run = build(rank, world_size, "1f1b", **options)
    states = _state(run)
    dcp.load({f"part{i}": s for i, s in zip(run.stage_indices, states)}, checkpoint_id=path)
    for part, opt, state in zip(run.parts, run.optimizers, states):
        set_state_dict(part, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(saved_at, saved_at + more):
        run.step(step)
        run.optimize()
    return run.params()


def _torchtitan_clip(params: list[torch.Tensor], max_norm: float, pp_mesh) -> float:
    """torch's clipping as torchtitan's ``clip_grad_norm_(..., pp_mesh=)`` runs it: the norm of this
    rank's gradients (DTensors: over their mesh), squared, summed over the pipeline stages."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm ** 2
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    norm = norm ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()
