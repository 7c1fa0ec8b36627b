"""The GPU check's ``runtimes`` section: dmuon's other step paths on one device, each against torch's pair.

Every row trains :class:`RowNet` (an embedding, residual MLP blocks of odd shapes, a norm and a head) on this
process's one-rank group with ``ExecutionConfig(loopback_collectives=True)``, so dmuon's collectives run for
real (self all-to-alls, all-reduces and all-gathers on NCCL's one-member groups), and compares the weights with
torch.optim.Muon + torch.optim.AdamW trained in this process on the same batches (fp32 Newton-Schulz on both
sides, :func:`fp32_torch_muon`):

``ddp``
    torch's ``DistributedDataParallel`` around the model, ``DMuon(ddp)`` (:mod:`dmuon.runtime.ddp`): the
    agreement's all-reduce and each wave's all-gather of the updates on dmuon's group every step;
``pipeline``
    ``torch.distributed.pipelining``'s GPipe schedule with one stage per rank (here the whole model), the
    model ``fully_shard``-ed, :data:`MICROBATCHES` micro-batches with the schedule's gradient scaling: the
    schedule reduces the gradients by hand after the last micro-batch and then divides them; dmuon learns that
    divisor in the first step, and from the second on every block launches from the reduction and stands
    (none rescaled, none exchanged again);
``fp16``
    fp16 autocast with ``torch.amp.GradScaler`` on FSDP2 (``unscale_`` before ``step()``), an inf put in one
    gradient at :data:`INF_STEP`: the launches from backward stand rescaled by the scaler's factor (kept, not
    exchanged again) from the second step on, but in the step after the skipped one (:func:`fp16_launches`),
    the inf's step is skipped (the weights bit for bit
    unchanged, the scale halved as torch's scaler halves it), and each good step equals torch's pair's with
    torch's scaler from the same weights (a free run parts by the next fp16 forward's rounding, see
    :func:`fp16_run`).

Each row's figures go to the section's JSON (rewritten after every row); :func:`runtimes_verdicts` judges them.
"""

from __future__ import annotations

import json
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.testing.reference import fp32_torch_muon

VOCAB, DIM, HIDDEN, BLOCKS = 61, 48, 104, 3
BATCH, SEQ = 6, 9
STEPS = 4
MICROBATCHES = 3
"""The pipeline's micro-batches per step: a divisor that is no power of two (its reciprocal is inexact)."""
FP16_STEPS, INF_STEP = 6, 3
FP16_SCALE = 2.0 ** 10
"""The scaler's initial scale: far from overflowing on this model, so only the injected inf skips a step."""
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW_KW = dict(lr=3e-3, weight_decay=0.01)
TOLERANCE = 1e-5
"""The largest weight difference from torch's pair that is fp32 rounding: both run fp32 Newton-Schulz (in
other orders) on the same gradients for a few steps, about 1e-7 apart; an update lost, applied twice, or
formed from a stale or unscaled gradient moves a weight by about ``lr / sqrt(DIM)``, 3e-3."""
ROWS = ("ddp", "pipeline", "fp16")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class RowNet(nn.Module):
    """The rows' model: its Muon matrices are the blocks' (one FSDP2 unit each); the root holds the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def row_net(device: torch.device) -> RowNet:
    """The same initial weights on every call."""
    torch.manual_seed(0)
    with torch.device(device):
        return RowNet()


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ``(tokens, targets)``, the same for dmuon and the reference."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(700 + step))
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole (a one-rank DTensor's local tensor is the whole parameter)."""
    from torch.distributed.tensor import DTensor

    return {name.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference over every parameter, and where (inf where a name is missing)."""
    if set(got) != set(want):
        return float("inf"), f"parameters differ: {sorted(set(got) ^ set(want))[:4]}"
    diffs = {name: float((got[name].double() - want[name].double()).abs().max()) for name in want}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


# ------------------------------------------------------------------ the reference: torch's pair
class TorchPair:
    """torch.optim.Muon on the model's Muon matrices (dmuon's default selection), AdamW on the rest."""

    def __init__(self, model: nn.Module) -> None:
        from dmuon.plan.selection import select_matrices

        matrices = {id(p) for _, p in select_matrices(model)}
        self.muon = torch.optim.Muon([p for p in model.parameters() if id(p) in matrices], **MUON_KW)
        self.adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in matrices], **ADAMW_KW)

    def step(self, scaler=None) -> None:
        with fp32_torch_muon():
            for opt in (self.muon, self.adamw):
                opt.step() if scaler is None else scaler.step(opt)

    def zero_grad(self) -> None:
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)


def reference(device: torch.device, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """torch's pair on the whole model and every step's whole batch, in this process."""
    model = row_net(device)
    pair = TorchPair(model)
    for step in range(steps):
        tokens, targets = batch(step, device)
        cross_entropy(model(tokens), targets).backward()
        pair.step()
        pair.zero_grad()
    return whole(model)


# ------------------------------------------------------------------ dmuon's runs
def make_dmuon(model: nn.Module, **execution):
    """DMuon with the pair's settings, loopback collectives (``execution``: other settings) and fp32 NS one
    matrix at a time, as torch's Muon runs it (nothing timed at build: no choice left to the device's timings)."""
    import dmuon

    return dmuon.DMuon(model, **MUON_KW, adamw=dmuon.AdamWConfig(**ADAMW_KW),
                       ns=dmuon.NSConfig(method="standard", dtype=torch.float32, batching="looped"),
                       execution=dmuon.ExecutionConfig(**{"loopback_collectives": True, **execution}))


def _sharded(model: RowNet, mesh) -> RowNet:
    """Each block ``fully_shard``-ed, then the root (the blocks are the units with Muon matrices)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _launches(opt) -> list[int]:
    """The last step's ``[blocks launched from backward that stood, of them rescaled]``."""
    stats = opt.last_step_stats()
    return [stats["blocks_exchanged_in_backward"], stats["rescaled_launches"]]


def all_gather_name() -> str:
    """The ``torch.distributed`` function the DDP runtime all-gathers the updates with (the same choice)."""
    import torch.distributed as dist

    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _counted(opt, counts: dict[str, int]):
    """Counts dmuon's collectives on its group: the exchanges, the agreement and the updates' all-gather."""
    from dmuon.bench.gpu_check_bench import counting_collectives

    names = ("all_to_all_single", "all_reduce", all_gather_name())
    return counting_collectives(opt.plan.topology.mesh_group, counts, names)


def ddp_run(device: torch.device) -> dict:
    """``DMuon(ddp)`` for :data:`STEPS` steps: the weights' distance from :func:`reference`, dmuon's collectives."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(row_net(device))
    opt = make_dmuon(ddp)
    counts, orthogonalized = {}, []
    with _counted(opt, counts):
        for step in range(STEPS):
            tokens, targets = batch(step, device)
            cross_entropy(ddp(tokens), targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            orthogonalized.append(opt.last_step_stats()["orthogonalized"])
    diff, worst = max_diff(whole(ddp), reference(device))
    return {"row": "ddp", "runtime": type(opt.runtime).__name__, "matrices": len(opt.plan.infos),
            "orthogonalized": orthogonalized, "collectives": counts, "max_diff": diff, "worst": worst}


def pipeline_run(device: torch.device) -> dict:
    """One stage per rank under GPipe (:data:`MICROBATCHES` micro-batches, the schedule's scaling) for
    :data:`STEPS` steps: each step's launches, the weights' distance from :func:`reference` (whole batches)."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("pp", "dp"))
    model = _sharded(row_net(device), mesh["dp"])
    opt = make_dmuon(model)
    stage = pipelining.PipelineStage(model, 0, 1, device, group=mesh.get_group("pp"))
    schedule = pipelining.ScheduleGPipe(stage, MICROBATCHES, loss_fn=cross_entropy, scale_grads=True)
    counts, launches = {}, []
    with _counted(opt, counts):
        for step in range(STEPS):
            tokens, targets = batch(step, device)
            schedule.step(tokens, target=targets)
            opt.step()
            opt.zero_grad(set_to_none=True)
            launches.append(_launches(opt))
    diff, worst = max_diff(whole(model), reference(device))
    return {"row": "pipeline", "blocks": len(opt.plan.blocks), "launches": launches, "collectives": counts,
            "max_diff": diff, "worst": worst}


INF_PARAM = "blocks.1.up.weight"
"""The Muon matrix whose gradient gets an inf at :data:`INF_STEP` (after backward launched it)."""


def _fp16_backward(model: nn.Module, step: int, device: torch.device, scaler) -> None:
    """The step's forward under fp16 autocast and the scaled loss's backward; an inf in :data:`INF_PARAM`'s
    gradient at :data:`INF_STEP` (what an overflow leaves)."""
    from torch.distributed.tensor import DTensor

    tokens, targets = batch(step, device)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = cross_entropy(model(tokens), targets)
    scaler.scale(loss).backward()
    if step == INF_STEP:
        grad = model.get_parameter(INF_PARAM).grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")


def _reference_fp16_step(model: RowNet, pair: TorchPair, scaler, step: int, device: torch.device,
                         start: dict[str, torch.Tensor]) -> bool:
    """torch's pair with torch's scaler on one step from dmuon's weights ``start`` (the pair's states its own);
    whether the step was skipped. torch's scaler skips each optimizer on its own infs; DMuon is one optimizer,
    so here an inf anywhere skips both, as it skips DMuon."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(start[name])
    _fp16_backward(model, step, device, scaler)
    scaler.unscale_(pair.muon)
    scaler.unscale_(pair.adamw)
    skipped = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    if not skipped:
        pair.step(scaler)
    scaler.update()
    pair.zero_grad()
    return skipped


def fp16_run(device: torch.device) -> dict:
    """fp16 autocast with ``torch.amp.GradScaler`` on FSDP2, :data:`FP16_STEPS` steps, each compared with torch's
    pair stepped from the same weights: run freely, the two part after a good step by one fp32 rounding in a
    weight, which the next fp16 forward can round to the other fp16 neighbour and Newton-Schulz then magnifies
    (about 1e-4, measured on CPU), where no tolerance tells a bug from rounding."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _sharded(row_net(device), init_device_mesh(device.type, (1,)))
    opt = make_dmuon(model)
    scaler = torch.amp.GradScaler(device.type, init_scale=FP16_SCALE)
    ref_model = row_net(device)
    pair, ref_scaler = TorchPair(ref_model), torch.amp.GradScaler(device.type, init_scale=FP16_SCALE)
    steps = []
    for step in range(FP16_STEPS):
        start, scale = whole(model), scaler.get_scale()
        _fp16_backward(model, step, device, scaler)
        scaler.unscale_(opt)
        scaler.step(opt)  # skipped where a gradient is inf or NaN
        scaler.update()
        opt.zero_grad(set_to_none=True)
        ours = whole(model)
        ref_skipped = _reference_fp16_step(ref_model, pair, ref_scaler, step, device, start)
        row = {"step": step, "skipped": scaler.get_scale() < scale, "reference_skipped": ref_skipped,
               "scale": scaler.get_scale(), "reference_scale": ref_scaler.get_scale()}
        if row["skipped"]:
            row["unchanged"] = max_diff(ours, start)[0] == 0.0
        else:
            row["max_diff"], row["worst"] = max_diff(ours, whole(ref_model))
            row["launches"] = _launches(opt)
        steps.append(row)
    return {"row": "fp16", "blocks": len(opt.plan.blocks), "steps": steps}


# ------------------------------------------------------------------ the section and its verdicts
RUNS = {"ddp": ddp_run, "pipeline": pipeline_run, "fp16": fp16_run}
CHECKS = {
    "ddp": "DMuon(ddp) on loopback collectives (agreement, updates' all-gather) equals torch's Muon + AdamW",
    "pipeline": f"one-stage GPipe, {MICROBATCHES} micro-batches (by-hand reduction, the divisor learned): "
                "launches stand, equals torch's Muon + AdamW",
    "fp16": "fp16 autocast + GradScaler on FSDP2: launches kept rescaled, the inf step skipped, each step "
            "equals torch's Muon + AdamW + GradScaler",
}
"""What each row checks: its name in the verdict table."""


def plan_runtimes() -> list[str]:
    """The rows, in the order they run."""
    return list(ROWS)


def runtimes_section(device: torch.device, out: str) -> dict:
    """Runs every row in this process's one-rank group (deterministic algorithms on CUDA); the JSON at ``out``
    is rewritten after every row, so a timeout still leaves the rows done."""
    from dmuon.bench.gpu_check_base import one_rank
    from dmuon.bench.gpu_check_bench import released_cleanly

    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    payload = {"rows": []}
    with one_rank(device) as backend:
        payload["backend"] = backend
        for name in ROWS:
            try:
                payload["rows"].append(RUNS[name](device))
                released_cleanly()
            except Exception as exc:  # the other rows still run; the verdict quotes the error
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                payload["rows"].append({"row": name, "error": error})
            with open(out, "w") as f:
                json.dump(payload, f)
    return payload


def _ddp_verdict(row: dict) -> tuple[bool, str]:
    counts = row["collectives"]
    gathers = counts.get(all_gather_name(), 0)
    ok = (row["runtime"] == "DdpRuntime" and row["orthogonalized"] == [row["matrices"]] * STEPS
          and counts.get("all_reduce", 0) >= STEPS and gathers >= STEPS and row["max_diff"] <= TOLERANCE)
    return ok, (f"max diff {row['max_diff']:.1e} ({row['worst']}) <= {TOLERANCE:.0e}; {row['runtime']}; "
                f"orthogonalized {row['orthogonalized']} of {row['matrices']}; collectives {counts}")


def _pipeline_verdict(row: dict) -> tuple[bool, str]:
    """The first step learns the divisor (every block exchanged in ``step()``), every later one launches every
    block from the schedule's reduction, divided alike, and keeps it as sent."""
    want = [[0, 0]] + [[row["blocks"], 0]] * (STEPS - 1)
    got = row["launches"]
    ok = got == want and row["collectives"].get("all_to_all_single", 0) > 0 and row["max_diff"] <= TOLERANCE
    return ok, (f"max diff {row['max_diff']:.1e} ({row['worst']}) <= {TOLERANCE:.0e}; (launched, rescaled) "
                f"per step {got}, expected {want}; collectives {row['collectives']}")


def fp16_launches(skipped: list[bool], blocks: int) -> list[list[int] | None]:
    """Per step, the ``(launched, rescaled)`` blocks of the fp16 row (None: a skipped step, whose report is not
    read). ``unscale_`` scales every gradient after backward launched it: the first step exchanges every block
    again (the owners hold no momentum copies yet), as does the step after a skipped one (its backward found the
    skipped step's launches in place); every other step keeps every launch, rescaled."""
    return [None if skip else [0, 0] if step == 0 or skipped[step - 1] else [blocks, blocks]
            for step, skip in enumerate(skipped)]


def _fp16_verdict(row: dict) -> tuple[bool, str]:
    steps = row["steps"]
    skipped = [s["skipped"] for s in steps]
    want_skipped = [step == INF_STEP for step in range(FP16_STEPS)]
    want = fp16_launches(want_skipped, row["blocks"])
    got = [s.get("launches") for s in steps]
    diffs = [s["max_diff"] for s in steps if "max_diff" in s]
    worst = max(diffs, default=float("inf"))
    ok = (skipped == want_skipped and [s["reference_skipped"] for s in steps] == want_skipped
          and all(s["scale"] == s["reference_scale"] for s in steps)
          and all(s["unchanged"] for s in steps if s["skipped"]) and got == want and worst <= TOLERANCE)
    scales = [s["scale"] for s in steps], [s["reference_scale"] for s in steps]
    return ok, (f"max diff per good step {worst:.1e} <= {TOLERANCE:.0e}; skipped {skipped}, expected "
                f"{want_skipped}; scales {scales[0]}, torch's {scales[1]}; (launched, rescaled) {got}, expected {want}")


VERDICTS = {"ddp": _ddp_verdict, "pipeline": _pipeline_verdict, "fp16": _fp16_verdict}


def runtimes_verdicts(payload: dict) -> list[dict]:
    """One check per row: its run's figures against what it checks (a missing or raising row fails)."""
    by = {row["row"]: row for row in payload.get("rows", [])}
    checks = []
    for name in ROWS:
        row = by.get(name)
        if row is None:
            passed, detail = False, "no run"
        elif "error" in row:
            passed, detail = False, row["error"][:2000]
        else:
            passed, detail = VERDICTS[name](row)
        checks.append({"name": f"runtimes {name}: {CHECKS[name]}", "passed": passed, "detail": detail})
    return checks


def fake_payload() -> dict:
    """Made-up rows of the real form for the dry run's table: the DDP and fp16 rows pass, the pipeline's last
    step has a launch exchanged again."""
    skipped = [step == INF_STEP for step in range(FP16_STEPS)]
    launches = fp16_launches(skipped, BLOCKS)
    fp16_steps = []
    for step, skip in enumerate(skipped):
        scale = FP16_SCALE / 2 if step >= INF_STEP else FP16_SCALE
        fp16_steps.append({"step": step, "skipped": skip, "reference_skipped": skip, "scale": scale,
                           "reference_scale": scale,
                           **({"unchanged": True} if skip else {"max_diff": 2e-8, "worst": "blocks.0.up.weight",
                                                                "launches": launches[step]})})
    matrices = 2 * BLOCKS
    rows = [{"row": "ddp", "runtime": "DdpRuntime", "matrices": matrices, "orthogonalized": [matrices] * STEPS,
             "collectives": {"all_reduce": STEPS, all_gather_name(): STEPS}, "max_diff": 0.0, "worst": "embed.weight"},
            {"row": "pipeline", "blocks": BLOCKS,
             "launches": [[0, 0]] + [[BLOCKS, 0]] * (STEPS - 2) + [[BLOCKS - 1, 0]],
             "collectives": {"all_reduce": 1, "all_to_all_single": 14}, "max_diff": 2e-7, "worst": "embed.weight"},
            {"row": "fp16", "blocks": BLOCKS, "steps": fp16_steps}]
    return {"backend": "nccl", "rows": rows}
