"""Rules that must not change silently (issue #63): what decides how a matrix is stepped is the selection and the
configuration, never where or when its work runs. Each test names the behaviour it stands for; each compares
against an independent reference (torch.optim.Muon + AdamW in one process, or the same run without the
disturbance) or counts what it keeps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from support.cases import full_params, sharded_oddnet
from support.equivalence import max_diff
from support.models import lm_loss, odd_batch, small_mlp as _small, small_mlp_batch as _small_batch
from support.spawn import run_distributed

FP32_NS = dmuon.NSConfig(method="standard", dtype=torch.float32)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- step() under the caller's autocast
def _autocast_run(step_autocast: bool, execution: dmuon.ExecutionConfig | None = None) -> dict[str, torch.Tensor]:
    model = _small()
    opt = dmuon.DMuon(model, lr=0.02, ns=FP32_NS, execution=execution)
    for step in range(3):
        x, y = _small_batch(step)
        ((model(x) - y) ** 2).mean().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step_autocast):
            opt.step()
        opt.zero_grad()
    opt.flush_updates()
    return _params(model)


def test_step_under_autocast_runs_as_configured_in_one_process():
    """The owners' work follows NSConfig.dtype, not the caller's autocast: ``step()`` inside
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` steps bit for bit as without it (fp32 NS; before, the
    NS matmuls ran in bf16 on the main thread: 2e-3 off after three steps)."""
    diff, where = max_diff(_autocast_run(True), _autocast_run(False))
    assert diff == 0.0, f"{where} differs by {diff}"


def _autocast_ranks(rank: int, world_size: int) -> dict | None:
    """Per execution: the run with ``step()`` (or the whole loop) under bf16 autocast against the run without."""
    out = {}
    variants = {
        "default, step under autocast": (dmuon.ExecutionConfig(), "step"),
        "ns_in_backward, whole loop under autocast": (dmuon.ExecutionConfig(ns_in_backward=True), "loop"),
        "next_forward, whole loop under autocast": (dmuon.ExecutionConfig(apply_updates="next_forward"), "loop"),
    }
    for name, (execution, where) in variants.items():
        results = []
        for autocast in (False, True):
            model, _, opt = sharded_oddnet(world_size, blocks=2, execution=execution)
            for step in range(3):
                # The forward always under autocast (the same gradients in both runs); the loop's backward and
                # step() under it in one run only.
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = lm_loss(model, odd_batch(step, rank))
                    if autocast and where == "loop":
                        loss.backward()
                if not (autocast and where == "loop"):
                    loss.backward()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    opt.step()
                opt.zero_grad()
            opt.flush_updates()
            results.append(full_params(model))
        out[name] = max_diff(*results)
    dist.barrier()
    return out if rank == 0 else None


def test_step_under_autocast_runs_as_configured_on_two_ranks():
    """On 2 ranks (FSDP2, fp32 NS) a matrix's result does not depend on whether its NS ran on the main
    thread (under the caller's autocast) or on the NS worker (never under it): ``step()``, and with
    ``ns_in_backward`` or ``apply_updates="next_forward"`` the whole loop, under bf16 autocast step bit for
    bit as without it (before: 8e-4 off after three steps)."""
    result = run_distributed(_autocast_ranks, 2)[0]
    for name, (diff, where) in result.items():
        assert diff == 0.0, f"{name}: {where} differs by {diff}"


# ------------------------------------------------------------------------------- a matrix that starts training later
NS_BF16 = dmuon.NSConfig(method="standard")  # torch.optim.Muon's iteration, in bf16 as torch's: bit for bit in one process
THAW_AT = 2
STEPS = 5


def _train_small(model: nn.Module, opts: list, steps: range) -> None:
    for step in steps:
        x, y = _small_batch(step)
        ((model(x) - y) ** 2).mean().backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()


def test_a_frozen_matrix_thawed_later_is_stepped_by_muon_in_one_process():
    """The rule follows the selection whenever a matrix starts training: ``DMuon(model)`` built with a frozen
    2-D weight (a backbone thawed after warm-up), then ``requires_grad_(True)``, steps it by Muon from that step
    on, bit for bit as torch.optim.Muon + AdamW holding it from the start (before: AdamW, silently). The groups
    stay as built (a scheduler's view of them), and the owners run one more NS per step."""
    model, reference = _small(), _small()
    for m in (model, reference):
        m[3].weight.requires_grad_(False)
    opt = dmuon.DMuon(model, lr=0.02, ns=NS_BF16)
    pair = [torch.optim.Muon([p for p in reference.parameters() if p.ndim == 2], lr=0.02),
            torch.optim.AdamW([p for p in reference.parameters() if p.ndim != 2], lr=0.02, weight_decay=0.01)]
    groups = [(g["algorithm"], len(g["params"])) for g in opt.param_groups]
    assert groups == [("muon", 3), ("adamw", 5)], groups  # the frozen matrix sits in the Muon half
    _train_small(model, [opt], range(THAW_AT))
    _train_small(reference, pair, range(THAW_AT))
    before = opt.last_step_stats()["orthogonalized"]
    frozen_value = model[3].weight.detach().clone()
    assert torch.equal(frozen_value, _small()[3].weight), "a frozen matrix is not stepped"
    for m in (model, reference):
        m[3].weight.requires_grad_(True)
    _train_small(model, [opt], range(THAW_AT, STEPS))
    _train_small(reference, pair, range(THAW_AT, STEPS))
    assert (before, opt.last_step_stats()["orthogonalized"]) == (2, 3)
    assert [(g["algorithm"], len(g["params"])) for g in opt.param_groups] == groups
    assert "momentum_buffer" in opt.state[model[3].weight]
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item()}"


def test_a_frozen_matrix_thawed_under_a_plan_of_the_user_s_raises_naming_it():
    """A plan given to DMuon was made with a selection DMuon cannot make again: a matrix it left out while
    frozen that trains later raises at ``step()``, naming it and the fix, before anything changes (it never goes
    to AdamW silently); and adding a parameter DMuon(model) already holds says why it is there."""
    model = _small()
    model[3].weight.requires_grad_(False)
    opt = dmuon.DMuon(model, dmuon.prepare(model, ns=NS_BF16), lr=0.02)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]
    _train_small(model, [opt], range(1))
    model[3].weight.requires_grad_(True)
    x, y = _small_batch(1)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(ValueError, match=r"'3.weight' trains now .* dmuon.prepare again"):
        opt.step()
    with pytest.raises(ValueError, match=r"more than one parameter group: '3.weight' is in param group 1"):
        opt.add_param_group({"params": [model[3].weight]})

    held = _small()
    held[3].weight.requires_grad_(False)
    own = dmuon.DMuon(held, lr=0.02, ns=NS_BF16)
    held[3].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'3.weight' is in param group 0 already \('muon'\).*requires_grad_\(True\) "
                                         r"is enough"):
        own.add_param_group({"params": [held[3].weight]})


THAWED = "layers.1.mid.weight"
"""OddNet's matrix frozen when DMuon is built and thawed at :data:`THAW_AT` on 2 ranks."""


def _thawed_ranks(rank: int, world_size: int, thaw_at: int) -> dict | None:
    from support.cases import freeze, make_mesh, shard_oddnet
    from support.models import OddNet

    mesh = make_mesh(world_size, None)
    torch.manual_seed(0)
    model = OddNet(blocks=2)
    freeze(model, (THAWED,))
    shard_oddnet(model, mesh)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), ns=FP32_NS)
    counts = []
    for step in range(STEPS):
        if step == thaw_at:
            model.get_parameter(THAWED).requires_grad_(True)  # on every rank, as the model is everywhere the same
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        count = torch.tensor([opt.last_step_stats()["orthogonalized"]])
        dist.all_reduce(count)
        counts.append(int(count))
    params = full_params(model)
    return {"params": params, "counts": counts} if rank == 0 else None


def _thawed_reference(thaw_at: int, world_size: int = 2) -> dict[str, torch.Tensor]:
    """torch.optim.Muon (fp32 NS) + AdamW in one process on every rank's batches, Muon holding the frozen
    matrix from the start (it steps nothing without a gradient)."""
    from support.models import OddNet
    from support.reference import torch_pair

    torch.manual_seed(0)
    model = OddNet(blocks=2)
    model.get_parameter(THAWED).requires_grad_(False)
    pair = torch_pair(model, dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True),
                      dict(lr=3e-3, weight_decay=0.01))
    for step in range(STEPS):
        if step == thaw_at:
            model.get_parameter(THAWED).requires_grad_(True)
        parts = [odd_batch(step, r) for r in range(world_size)]
        lm_loss(model, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))).backward()
        pair.hand_grads()
        pair.step(torch.float32)
        pair.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_frozen_matrix_thawed_later_is_stepped_by_muon_on_two_ranks():
    """On 2 FSDP2 ranks: ``DMuon(model)`` built with a frozen matrix, thawed at step 2 on every rank: every rank
    finds it at that ``step()`` and makes the plan again (one more NS per step over the ranks from then on), and
    the run equals torch.optim.Muon + AdamW in one process holding it in Muon from the start (before: AdamW
    stepped it, the NS count unchanged)."""
    result = run_distributed(_thawed_ranks, 2, THAW_AT)[0]
    counts = result["counts"]
    assert counts[THAW_AT:] == [counts[0] + 1] * (STEPS - THAW_AT) and counts[:THAW_AT] == [counts[0]] * THAW_AT, counts
    diff, where = max_diff(result["params"], _thawed_reference(THAW_AT))
    assert diff <= 1e-5, f"{where} differs by {diff}"


# ------------------------------------------------------------------------------------ add_param_group after setup
def _added_ranks(rank: int, world_size: int) -> dict:
    """A matrix frozen when DMuon is built from the trainable parameters (so no group holds it), thawed and
    ``add_param_group``-ed at :data:`THAW_AT`: under FSDP2 with each ``apply_updates``, and under torch's DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from support.cases import freeze, make_mesh, shard_oddnet
    from support.models import OddNet

    out: dict = {}
    for route in ("in_step", "next_forward", "ddp"):
        torch.manual_seed(0)
        model = OddNet(blocks=2)
        freeze(model, (THAWED,))
        if route == "ddp":
            target = DDP(model)
        else:
            shard_oddnet(model, make_mesh(world_size, None))
            target = model
        opt = dmuon.DMuon([p for p in model.parameters() if p.requires_grad], module=target, lr=0.02,
                          adamw=dmuon.AdamWConfig(lr=3e-3), ns=FP32_NS,
                          execution=dmuon.ExecutionConfig(apply_updates="in_step" if route == "ddp" else route))
        counts = []
        for step in range(STEPS):
            if step == THAW_AT:
                weight = model.get_parameter(THAWED)
                weight.requires_grad_(True)
                # The plan is made again here, on every rank; under next_forward the last step's updates, held
                # for this forward, are applied first.
                opt.add_param_group({"params": [weight]})
            lm_loss(target, odd_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            count = torch.tensor([opt.last_step_stats()["orthogonalized"]])
            dist.all_reduce(count)
            counts.append(int(count))
        opt.flush_updates()
        params = full_params(model)
        if route == "ddp":
            # DDP built while the matrix was frozen does not reduce its gradient (torch's DDP registers its
            # hooks at construction): its owner's update reaches every rank, so every rank holds the same model.
            gathered = [None] * world_size
            dist.all_gather_object(gathered, params)
            out[route] = {"counts": counts, "same": max(max_diff(gathered[0], g)[0] for g in gathered)}
        else:
            out[route] = {"counts": counts, "params": params}
    return out if rank == 0 else None


def test_add_param_group_after_setup_keeps_the_held_updates_and_works_under_ddp():
    """``add_param_group`` after setup makes the plan again without losing a step: under
    ``apply_updates="next_forward"`` the updates the last step held for the next forward are applied first
    (before: dropped, 1.1e-2 from ``in_step`` two steps later), so both equal torch.optim.Muon + AdamW in one
    process; under torch's DDP the plan is made again over DDP's group (before: it raised after the old runtime
    was gone) and the thawed matrix's NS runs from that step on."""
    result = run_distributed(_added_ranks, 2)[0]
    reference = _thawed_reference(THAW_AT)
    for route in ("in_step", "next_forward"):
        diff, where = max_diff(result[route]["params"], reference)
        assert diff <= 1e-5, f"{route}: {where} differs from torch's pair by {diff}"
    diff, where = max_diff(result["in_step"]["params"], result["next_forward"]["params"])
    assert diff <= 1e-6, f"next_forward: {where} differs from in_step by {diff}"
    for route, r in result.items():
        counts = r["counts"]
        assert counts[THAW_AT:] == [counts[0] + 1] * (STEPS - THAW_AT), (route, counts)
    assert result["ddp"]["same"] == 0.0


# ------------------------------------------------------------------------------------------ a tensor lr on the host
class _Reads:
    """Host reads while entered: the dispatch counter's (``.item()``, ``bool(t)``, ``torch.equal``) and every
    ``Tensor.tolist()`` (which dispatches nothing on CPU, so the counter alone would not see it)."""

    def __init__(self, ignored) -> None:
        from dmuon.bench.op_count import HostReadCounter

        self.counter = HostReadCounter(ignored)
        self.tolist = 0

    def __enter__(self):
        original = self._original = torch.Tensor.tolist

        def counted(t, *args, **kwargs):
            self.tolist += 1
            return original(t, *args, **kwargs)

        torch.Tensor.tolist = counted
        self.counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.counter.__exit__(*exc)
        torch.Tensor.tolist = self._original

    @property
    def count(self) -> int:
        return self.counter.count + self.tolist


@pytest.mark.parametrize("apply_updates", ["in_step", "next_forward"])
def test_a_tensor_lr_is_read_to_the_host_once_per_step(apply_updates):
    """A tensor Muon ``lr`` (changed in place every step by a scheduler) costs one host read per step at most,
    however many matrices there are (before: one per matrix, each a device sync; under ``next_forward`` inside
    the units' forwards), counted over the forward, backward and ``step()``; the steps equal the float-lr run's
    (the alphas read are torch.optim.Muon's values, bit for bit)."""
    def run(lr) -> tuple[list[int], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
        opt = dmuon.DMuon(model, lr=lr, ns=NS_BF16, adamw=dmuon.AdamWConfig(lr=0.01),
                          execution=dmuon.ExecutionConfig(apply_updates=apply_updates))
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        counts = []
        for step in range(4):
            ignored = [s["step"] for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)]
            with _Reads(ignored) as reads:  # AdamW's step counters live on the host: not counted
                g = torch.Generator().manual_seed(step)
                model(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
            opt.zero_grad()
            scheduler.step()
            counts.append(reads.count)
        opt.flush_updates()
        return counts, _params(model)

    (floats, expected), (tensors, got) = run(0.02), run(torch.tensor(0.02))
    # The first step sets up (its own reads, the same either way); from then on at most one more read.
    assert all(t - f <= 1 for t, f in zip(tensors[1:], floats[1:])), (floats, tensors)
    diff, where = max_diff(got, expected)
    assert diff == 0.0, f"{where} differs by {diff}"


# ------------------------------------------------------------------------------------------------ small host costs
class _Ops:
    """Counts every aten op dispatched while entered."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self._mode = 0, Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def _clipped(layers: int, norm_type: float) -> tuple[int, torch.Tensor, torch.Tensor, float]:
    """DMuon's clip on a ``layers``-Linear model and torch's on a copy: the ops DMuon's dispatched, the largest
    difference between the clipped gradients, and both norms."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])

    ours, theirs = model(), model()
    opt = dmuon.DMuon(ours, lr=0.02, ns=NS_BF16)
    for m in (ours, theirs):
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    opt.clip_grad_norm_(1e9)  # sets the optimizer up (its first call); clips nothing at this bound
    with _Ops() as ops:
        norm = opt.clip_grad_norm_(0.1, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type)
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return ops.count, diff, norm, expected


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_runs_a_constant_number_of_kernels_per_group(norm_type):
    """``DMuon.clip_grad_norm_`` is foreach, as torch's: one ``_foreach_norm`` and one ``_foreach_mul_`` per
    (device, dtype) group of gradients, so the ops it dispatches do not grow with the parameters (before: about
    five per parameter); the norm and the clipped gradients are torch's clip_grad_norm_'s in one process."""
    few, diff_few, norm_few, expected_few = _clipped(3, norm_type)
    many, diff_many, norm_many, expected_many = _clipped(9, norm_type)
    assert few == many, (few, many)
    for diff, norm, expected in ((diff_few, norm_few, expected_few), (diff_many, norm_many, expected_many)):
        assert torch.allclose(norm, expected, rtol=1e-6, atol=0), (norm, expected)
        assert diff <= 1e-7, diff


def test_the_agreement_s_host_flags_go_through_pinned_memory_on_an_accelerator(monkeypatch):
    """The step's host-built flags reach an accelerator through pinned memory, non-blocking (a pageable copy
    makes the host wait every step); on the CPU they are used as they are, no copy and no pinning."""
    from dmuon.runtime import agreement

    assert agreement.pins_host_copies(torch.device("cuda", 0)) and agreement.pins_host_copies("xpu")
    assert not agreement.pins_host_copies("cpu")
    host = torch.arange(4, dtype=torch.int32)
    assert agreement.host_to_device(host, "cpu") is host
    calls = []

    class Pinned:
        def to(self, device, non_blocking=False):
            calls.append((device, non_blocking))
            return host

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pinned") or Pinned())
    agreement.host_to_device(host, torch.device("cuda", 0))
    assert calls == ["pinned", (torch.device("cuda", 0), True)]


@pytest.mark.parametrize("rule", ["muon", "normuon", "muonh", "dion2"])
def test_updates_applied_in_the_next_forward_keep_their_steps_lr_under_a_scheduler(rule):
    """``apply_updates="next_forward"`` lands a step's updates after the caller's ``scheduler.step()``;
    torch.optim.Muon applies each step's update with that step's lr and weight decay, so the held updates keep
    the settings of the step that made them (they took the next step's lr: 4e-2 off after four steps)."""
    from support.cases import rule_optimizer

    def run(mode: str) -> list[torch.Tensor]:
        model = _small()
        opt = rule_optimizer(rule, model, None, lr=0.05, weight_decay=0.1, ns=FP32_NS,
                             execution=dmuon.ExecutionConfig(apply_updates=mode))
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 3 * s))
        for step in range(4):
            x, y = _small_batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
        opt.flush_updates()
        return [p.detach().clone() for p in model.parameters()]

    held, applied = run("next_forward"), run("in_step")
    assert all(torch.equal(a, b) for a, b in zip(held, applied))
