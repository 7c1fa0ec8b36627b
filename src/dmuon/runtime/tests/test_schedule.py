"""The runtime's step on its own: fake callbacks, no model, 4 gloo ranks on four layouts.

One file over 500 lines: the fake rule, its expected values and the tests that read them are one
argument, read top to bottom; apart, each half would only make sense with the other open.

A fake rule stands in for the optimizer: its "state" is a per-matrix step
count, a direction is the gradient plus that count (elementwise, as momentum
is), and the owner's work mixes whole rows and whole columns
(``D + colsum/2 + rowsum/4``), so an update is right only if the owner got the
whole direction. Gradients are known pieces of known full matrices, written
through autograd so that the runtime's post-accumulate-grad hooks fire as
FSDP2 makes them fire. Each scenario checks every rank's applied rows against
the expected ones computed here from the full matrices, and what the step
report says it did: speculation kept or dropped, launches kept, return waves,
skipped and failed steps.

A second fake rule keeps a row state (``row_width = 2`` values per row, held by
every holder of a row): the owner adds each row's first value to the update
and returns ``(state[:, 0] / 2 + rowsum(D), state[:, 1] + 1)``, so both are right
only if the owner got every row's state and the whole direction, and every
holder stores what came back. Its "edit" doubles one matrix's state on every
holder between backward and ``step()``: the launch sent the old state, so it
must go stale.

Both rules also have step maxima (``step_maxima``, as QK-clip's logit maxima):
each rank's values differ, with a NaN and negative values on some ranks and
values no 16-bit float holds, so ``finish_step`` must get, once per applied
step and never for a skipped one, the exact maximum over every rank, on every
path the step takes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dmuon.comm.tests.test_exchange import _tp_pieces
from dmuon.comm.topology import from_mesh
from dmuon.ortho.config import NSConfig
from dmuon.plan.plan import BlockInfo, MatrixInfo, Plan, row_pieces
from dmuon.runtime import CheckedGradients, ExecutionConfig, RowState, ShardRuntime, StepCallbacks, StepMaxima
from support.spawn import run_distributed

# Its point is stream order (the overlapped step's order): every rank runs under the stream checker.
pytestmark = pytest.mark.streams

WORLD = 4
# Uneven rows, a conv kernel, a 1xn matrix; matrix 4 never gets a gradient (an unused matrix in
# block 1) and matrix 6 is not stepped by the optimizer (outside its param groups).
SHAPES = [(37, 21), (5, 7), (6, 3, 3), (8, 16), (3, 5), (9, 4), (12, 6), (1, 10)]
BLOCKS = [0, 0, 0, 1, 1, 2, 2, 2]
OWNERS = [3, 1, 2, 0, 3, 2, 1, 3]
UNUSED, UNMANAGED = 4, 6
MANAGED = [k for k in range(len(SHAPES)) if k != UNMANAGED]
MESHES = {"1-D": (None, "rows"), "2x2": ((2, 2), "rows"), "1-D tp": (None, "tp"), "2x2 tp": ((2, 2), "tp")}
STEPS = 3
EDITED = (1, 0)  # (rank, matrix) whose gradient an "edit" scales between backward and step()


def _grid(mesh: str) -> tuple[int, int]:
    shape = MESHES[mesh][0]
    return (1, WORLD) if shape is None else shape


def _infos(mesh: str, params: list[nn.Parameter] | None = None) -> list[MatrixInfo]:
    replicate, shard = _grid(mesh)
    tp = MESHES[mesh][1] == "tp"
    return [MatrixInfo(index=k, name=f"m{k}", param=params[k] if params else nn.Parameter(torch.zeros(0)),
                       shape=shape, block=BLOCKS[k], owner=OWNERS[k], replicate=replicate,
                       pieces=_tp_pieces(k, shape, shard) if tp else row_pieces(shape, shard))
            for k, shape in enumerate(SHAPES)]


def _full_grad(k: int, step: int) -> torch.Tensor:
    return torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(100 * step + k))


def _box(info: MatrixInfo, s: int, full: torch.Tensor) -> torch.Tensor:
    """Piece ``s`` of a parameter-shaped tensor, as a local shard holds it."""
    p = info.pieces[s]
    return full[p.row : p.row + p.rows, p.col : p.col + p.cols]


def _kept(info: MatrixInfo, r: int, s: int, piece: torch.Tensor) -> torch.Tensor:
    """The columns of piece ``s`` whose state replica ``r`` keeps (all of them without HSDP)."""
    return piece.narrow(1, info.column_start(r, s), info.replica_columns(s)[r])


def _grad_piece(info: MatrixInfo, r: int, s: int, step: int, scale_edit: bool) -> torch.Tensor:
    piece = _box(info, s, _full_grad(info.index, step)).clone()
    if scale_edit and (r * _grid_shard(info) + s, info.index) == EDITED:
        piece *= 0.5
    return piece


def _grid_shard(info: MatrixInfo) -> int:
    return len(info.pieces)


def _owner_fn(d: torch.Tensor) -> torch.Tensor:
    """The fake owner work: needs the whole matrix (column and row sums)."""
    return d + d.sum(0, keepdim=True) * 0.5 + d.sum(1, keepdim=True) * 0.25


ROW_EDITED = 0
"""The matrix whose row state the row rule's "edit" doubles between backward and step()."""


def _initial_rows(k: int) -> torch.Tensor:
    """Matrix ``k``'s whole row state before the first step."""
    return torch.arange(SHAPES[k][0] * 2, dtype=torch.float32).view(-1, 2) / 7 + k


def _row_update(d: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row rule's owner work on one whole matrix: its update and its new row state."""
    new = torch.stack([rows[:, 0] / 2 + d.sum(1), rows[:, 1] + 1], dim=1)
    return _owner_fn(d) + rows[:, :1], new


def _step_maxima(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s step maxima at ``step``: each value's maximum is on another rank; a NaN (rank 1)
    and negative values count as 0; one +inf; none of the finite ones is exact in bf16."""
    return torch.tensor([100.0 + step + rank / 3, 1e30 / (rank + 1 + step),
                         float("nan") if rank == 1 else 2.0 + rank / 3, -1.0 - rank,
                         float("inf") if (rank, step) == (2, 1) else 0.5], dtype=torch.float32)


def _agreed_maxima(step: int) -> torch.Tensor:
    values = torch.stack([_step_maxima(rank, step) for rank in range(WORLD)])
    return torch.where(values > 0, values, 0.0).amax(0)


class FakeRule(StepCallbacks, StepMaxima, CheckedGradients):
    """Direction = gradient + steps committed so far; the owner mixes rows and columns."""

    def __init__(self, infos: list[MatrixInfo], position: tuple[int, int], checked: list[torch.Tensor]) -> None:
        self.infos, self.position = infos, position
        self.count = {k: 0 for k in MANAGED}
        self.applied: dict[int, torch.Tensor] = {}
        self.events: list[str] = []
        self.checked = checked
        self.worker_threads: set[str] = set()
        self.step_index = 0
        self.finished: list[tuple[list[int], torch.Tensor]] = []

    def _part(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        # The runtime's part must be this rank's kept columns of its piece of the gradient.
        info = self.infos[i]
        assert torch.equal(grad, _kept(info, *self.position, info.param.grad)), f"matrix {i}: wrong gradient part"
        return (grad + self.count[i]).reshape(-1)

    def matrices(self) -> list[int]:
        return list(MANAGED)

    def peek(self, members, grads):
        self.events.append("peek")
        return {i: self._part(i, grads[i]) for i in members}

    def commit(self, members, grads):
        self.events.append("commit")
        out = {i: self._part(i, grads[i]) for i in members}
        for i in members:
            self.count[i] += 1
        return out

    def owner_work(self, batch, directions):
        import threading

        self.worker_threads.add(threading.current_thread().name)
        return [_owner_fn(d) for d in directions]

    def apply(self, updates):
        self.events.append("apply")
        for i, rows in updates.items():
            assert i not in self.applied, f"matrix {i} applied twice in one step"
            self.applied[i] = rows.clone()

    def independent(self):
        self.events.append("independent")

    def step_maxima(self):
        return _step_maxima(self.position[0] * len(self.infos[0].pieces) + self.position[1], self.step_index)

    def finish_step(self, active, maxima):
        self.events.append("finish")
        self.finished.append((list(active), maxima.clone()))

    def checked_gradients(self):
        return [(f"other{k}", g) for k, g in enumerate(self.checked)]


class FakeRowRule(FakeRule, RowState):
    """:class:`FakeRule` with a row state (see the module docstring), stored as views like NorMuon's."""

    row_width = 2

    def __init__(self, infos: list[MatrixInfo], position: tuple[int, int], checked: list[torch.Tensor]) -> None:
        super().__init__(infos, position, checked)
        s = position[1]
        self.rows = {k: _initial_rows(k)[infos[k].pieces[s].row:][: infos[k].pieces[s].rows].clone()
                     for k in range(len(SHAPES))}

    def row_states(self, members):
        return {i: self.rows[i] for i in members}

    def owner_work(self, batch, directions, rows=None):
        assert rows is not None and all(r.shape == (d.shape[0], 2) for r, d in zip(rows, directions))
        done = [_row_update(d, r) for d, r in zip(directions, rows)]
        return [u for u, _ in done], [n for _, n in done]

    def apply(self, updates, rows=None):
        super().apply(updates)
        assert set(rows) == set(updates), (sorted(rows), sorted(updates))
        for i, new in rows.items():
            self.rows[i].copy_(new)


def _scenario(mesh: str, name: str) -> tuple[dict, list]:
    """(ExecutionConfig keywords, per step: edit?, NaN where) of a named scenario."""
    plain = [{}] * STEPS
    return {
        "speculative": ({}, plain),
        "edited": ({}, [{}, {"edit": True}, {}]),
        "sync": (dict(overlap=False), [{}, {"edit": True}, {}]),
        "waves": (dict(return_waves=3), [{}, {"edit": True}, {}]),
        "ns_in_backward": (dict(ns_in_backward=True), [{}, {"edit": True}, {}]),
        "skip": (dict(nonfinite="skip"), [{}, {"nan_other": 2}, {"edit": True}]),
        "skip_matrix": (dict(nonfinite="skip"), [{"nan_matrix": (3, 3)}, {}, {}]),
        "raise": (dict(nonfinite="raise"), [{}, {"nan_matrix": (0, 3)}]),
        "rows speculative": ({}, plain),
        "rows edited": ({}, [{}, {"edit_rows": True}, {}]),
        "rows waves": (dict(return_waves=3), [{}, {"edit_rows": True}, {}]),
        "rows ns_in_backward": (dict(ns_in_backward=True), [{}, {"edit_rows": True}, {}]),
        "rows skip": (dict(nonfinite="skip"), [{}, {"nan_other": 2}, {"edit_rows": True}]),
    }[name]


SCENARIOS = ["speculative", "edited", "sync", "waves", "ns_in_backward", "skip", "skip_matrix", "raise",
             "rows speculative", "rows edited", "rows waves", "rows ns_in_backward", "rows skip"]
ROW_EDIT_STEP = 1
"""The step of the row scenarios whose row state is edited (all but "rows speculative")."""


def run_scenarios(rank: int, world_size: int, mesh: str) -> dict:
    """Worker: every scenario on a fresh runtime; per step the applied rows, events and report."""
    shape = MESHES[mesh][0]
    device_mesh = init_device_mesh("cpu", (world_size,)) if shape is None else \
        init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    topo = from_mesh(device_mesh, replicated=shape is not None)
    r, s = topo.position
    out = {"position": (r, s), "plan_rank": topo.rank}
    for name in SCENARIOS:
        skeleton = _infos(mesh)
        params = [nn.Parameter(torch.zeros(_box(info, s, torch.zeros(info.shape)).shape)) for info in skeleton]
        infos = _infos(mesh, params)
        blocks = [BlockInfo(b, f"b{b}", nn.Module(), [k for k in range(len(SHAPES)) if BLOCKS[k] == b])
                  for b in sorted(set(BLOCKS))]
        plan = Plan(infos, blocks, world_size, topo.rank, "given", topo.replicate, device_mesh)
        plan.topology, plan.device, plan.ns = topo, torch.device("cpu"), NSConfig(method="standard", dtype=torch.float32)
        config, steps = _scenario(mesh, name)
        other = torch.zeros(3)
        rule = (FakeRowRule if name.startswith("rows") else FakeRule)(infos, (r, s), [other])
        runtime = ShardRuntime(plan, rule, ExecutionConfig(**config))
        record = []
        for step, what in enumerate(steps):
            for p in params:
                p.grad = None
            other.zero_()
            if what.get("nan_other") == topo.rank:
                other[1] = float("nan")
            # Backward, last block first as FSDP2 runs it; the unused matrix gets nothing.
            for b in reversed(blocks):
                for k in b.members:
                    if k != UNUSED:
                        params[k].backward(_grad_piece(infos[k], r, s, step, scale_edit=False))
            if what.get("edit"):
                for k in range(len(SHAPES)):
                    if k != UNUSED:
                        params[k].grad.copy_(_grad_piece(infos[k], r, s, step, scale_edit=True))
            if what.get("edit_rows"):
                rule.rows[ROW_EDITED].mul_(2)  # in place, on every holder alike
            if "nan_matrix" in what and what["nan_matrix"][0] == topo.rank:
                k = what["nan_matrix"][1]
                if params[k].grad.numel():
                    params[k].grad.view(-1)[0] = float("nan")
            rule.applied, rule.events, rule.finished, rule.step_index = {}, [], [], step
            try:
                report = runtime.step()
            except FloatingPointError as err:
                record.append({"raised": str(err)})
                break
            record.append({"applied": rule.applied, "events": list(rule.events), "report": report.as_dict(),
                           "count": dict(rule.count), "finished": list(rule.finished),
                           "rows": {k: v.clone() for k, v in getattr(rule, "rows", {}).items()}})
        out[name] = {"steps": record, "worker_threads": sorted(rule.worker_threads)}
        runtime.close()
    return out


def run_every_layout(rank: int, world_size: int) -> dict:
    """Worker: :func:`run_scenarios` on each layout in turn, in one process group (a spawn costs more); a
    layout that raised fails only the tests that read it (:func:`support.scenarios.run_each`)."""
    from support.scenarios import run_each

    return run_each({mesh: functools.partial(run_scenarios, rank, world_size, mesh) for mesh in MESHES})


@functools.cache
def _every_layout() -> list[dict]:
    return run_distributed(run_every_layout, WORLD, timeout_s=240)


def _results(mesh: str) -> list[dict]:
    return [r[mesh] for r in _every_layout()]


def _directions(mesh: str, step: int, count: int, edited: bool) -> dict[int, torch.Tensor]:
    """Every managed matrix's whole direction at ``step``, its state at ``count``, ``(m, n)``."""
    replicate, shard = _grid(mesh)
    infos = _infos(mesh)
    out = {}
    for k in MANAGED:
        if k == UNUSED:
            continue
        info = infos[k]
        d = torch.zeros(info.shape)
        for r in range(replicate):
            for s in range(shard):
                if not info.pieces[s].sends:
                    continue
                p = info.pieces[s]
                part = _kept(info, r, s, _grad_piece(info, r, s, step, edited)) + count
                start = p.col + info.column_start(r, s)
                d[p.row : p.row + p.rows, start : start + part.shape[1]] = part
        out[k] = d.reshape(info.matrix_shape)
    return out


def _expected(mesh: str, step: int, count: int, edited: bool) -> dict[int, torch.Tensor]:
    """Every managed matrix's whole update at ``step``, its state at ``count`` (the count is the
    same for every matrix here: each one steps whenever the step is not skipped)."""
    return {k: _owner_fn(d) for k, d in _directions(mesh, step, count, edited).items()}


def _check_applied(mesh: str, res: dict, name: str, step: int, count: int, edited: bool) -> None:
    infos = _infos(mesh)
    s = res["position"][1]
    got = res[name]["steps"][step]["applied"]
    where = f"{mesh} {name} rank {res['plan_rank']} step {step}"
    expected = _expected(mesh, step, count, edited)
    holds = {k for k in expected if infos[k].piece_numel(s)}
    assert set(got) == holds, f"{where}: applied {sorted(got)}, expected {sorted(holds)}"
    for k in holds:
        want = infos[k].cut(expected[k], s).view(got[k].shape)
        assert torch.equal(got[k], want), f"{where}: matrix {k} {SHAPES[k]}"


def _reports(results: list[dict], name: str, step: int) -> list[dict]:
    return [r[name]["steps"][step]["report"] for r in results]


@pytest.mark.parametrize("mesh", MESHES)
def test_overlapped_step_applies_the_owners_updates(mesh):
    results = _results(mesh)
    blocks = len(set(BLOCKS))
    for step in range(STEPS):
        for res in results:
            _check_applied(mesh, res, "speculative", step, step, edited=False)
            events = res["speculative"]["steps"][step]["events"]
            # The rule's order: directions committed, AdamW's slot, then the updates.
            assert events[0] == "commit" and events.count("independent") == 1, events
            assert events.index("independent") < events.index("apply"), events
        reports = _reports(results, "speculative", step)
        # Every block launched from backward and kept; all owner work ran while agreeing.
        assert all(rep["blocks_exchanged_in_backward"] == blocks for rep in reports)
        assert sum(rep["orthogonalized_while_agreeing"] for rep in reports) == \
            sum(rep["orthogonalized"] for rep in reports) == len(MANAGED) - 1  # the unused one has no gradient
        assert all(rep["return_waves"] == [[k for k in MANAGED if k != UNUSED]] for rep in reports)


@pytest.mark.parametrize("mesh", MESHES)
def test_an_edit_on_one_rank_drops_that_launch_on_every_rank(mesh):
    results = _results(mesh)
    for name in ("edited", "sync", "waves", "ns_in_backward"):
        for step in range(STEPS):
            edited = step == 1
            for res in results:
                _check_applied(mesh, res, name, step, step, edited)
            reports = _reports(results, name, step)
            kept = {rep["blocks_exchanged_in_backward"] for rep in reports}
            launched = 0 if name == "sync" else len(set(BLOCKS))
            # The edited matrix's block fails the check on its rank, so on every rank.
            assert kept == {launched - (1 if edited and launched else 0)}, (name, step, kept)
            # Only the speculative step (one wave, launches, no worker) orthogonalizes while
            # agreeing, and keeps it only when no launch went stale.
            while_agreeing = sum(rep["orthogonalized_while_agreeing"] for rep in reports)
            assert (while_agreeing > 0) == (name == "edited" and not edited), (name, step, while_agreeing)
    # The owners' batches of the 2 matrices some owners hold go in separate waves.
    waves = _reports(results, "waves", 0)[0]["return_waves"]
    assert len(waves) > 1 and sorted(sum(waves, [])) == [k for k in MANAGED if k != UNUSED], waves
    # NS in backward: the worker did the unedited steps' work, the edited step redid it in step().
    for res in results:
        assert res["ns_in_backward"]["worker_threads"] in (["dmuon-ns"], ["MainThread", "dmuon-ns"]), \
            res["ns_in_backward"]["worker_threads"]
    for step in range(STEPS):
        reports = _reports(results, "ns_in_backward", step)
        done = sum(rep["orthogonalized_in_backward"] for rep in reports)
        outside_block_0 = sum(1 for k in MANAGED if k != UNUSED and BLOCKS[k] != 0)
        assert done == (outside_block_0 if step == 1 else len(MANAGED) - 1), (step, done)


@pytest.mark.parametrize("mesh", MESHES)
def test_step_maxima_reach_finish_step_exactly_once_per_applied_step(mesh):
    """Every scenario (speculation kept and dropped, overlap=False, waves, NS in backward, skipped
    steps, row state): ``finish_step`` runs once, last, with the exact maximum over every rank of
    the step's maxima, on every rank of an applied step, and not at all on a skipped one."""
    active = [k for k in MANAGED if k != UNUSED]
    for res in _results(mesh):
        for name in SCENARIOS:
            for step, record in enumerate(res[name]["steps"]):
                where = f"{mesh} {name} rank {res['plan_rank']} step {step}"
                if "raised" in record:
                    continue
                if record["report"]["skipped_nonfinite"]:
                    assert record["finished"] == [] and "finish" not in record["events"], where
                    continue
                assert record["events"][-1] == "finish" and record["events"].count("finish") == 1, where
                [(got_active, maxima)] = record["finished"]
                assert got_active == active, where
                assert torch.equal(maxima, _agreed_maxima(step)), (where, maxima, _agreed_maxima(step))


@pytest.mark.parametrize("mesh", MESHES)
def test_nonfinite_gradients_skip_or_fail_every_rank_alike(mesh):
    results = _results(mesh)
    for res in results:
        steps = res["skip"]["steps"]
        _check_applied(mesh, res, "skip", 0, 0, edited=False)
        # A NaN in another parameter's gradient on rank 2 skips the step everywhere: no state
        # advances, nothing is applied, AdamW's slot does not run.
        assert steps[1]["report"]["skipped_nonfinite"] and steps[1]["applied"] == {}
        assert steps[1]["events"] == [] and steps[1]["count"] == steps[0]["count"]
        _check_applied(mesh, res, "skip", 2, 1, edited=True)
        # A NaN in a matrix's gradient (on its one rank holding rows of it) skips the first step.
        first = res["skip_matrix"]["steps"][0]
        assert first["report"]["skipped_nonfinite"] and first["applied"] == {}
        _check_applied(mesh, res, "skip_matrix", 1, 0, edited=False)
        # "raise": every rank raises, naming the matrix.
        raised = res["raise"]["steps"][-1]
        assert "m3" in raised.get("raised", ""), raised
        _check_applied(mesh, res, "raise", 0, 0, edited=False)


def _expected_with_rows(mesh: str, step: int, edit_at: int | None, skipped: int | None = None) -> tuple[dict, dict]:
    """The row rule: every stepped matrix's whole update at ``step`` and every matrix's whole row
    state after it (``edit_at``: the step before whose ``step()`` matrix ROW_EDITED's state doubled;
    ``skipped``: a step that a non-finite gradient skipped, nothing applied, no state advanced)."""
    rows = {k: _initial_rows(k) for k in range(len(SHAPES))}
    updates: dict = {}
    count = 0
    for t in range(step + 1):
        if t == edit_at:
            rows[ROW_EDITED] = rows[ROW_EDITED] * 2
        updates = {}
        if t == skipped:
            continue
        for k, d in _directions(mesh, t, count, edited=False).items():
            updates[k], rows[k] = _row_update(d, rows[k])
        count += 1
    return updates, rows


@pytest.mark.parametrize("mesh", MESHES)
def test_a_row_state_travels_with_its_matrix_and_back_to_every_holder(mesh):
    """The row rule on every path (speculative, waves, NS in backward, a launch made stale by an
    edit of the row state alone, a step skipped for a non-finite gradient): every holder of a row
    applies the update made with the whole state and ends with the owner's new state of its rows."""
    infos = _infos(mesh)
    results = _results(mesh)
    blocks = len(set(BLOCKS))
    for name in ("rows speculative", "rows edited", "rows waves", "rows ns_in_backward", "rows skip"):
        edit_at = {"rows speculative": None, "rows skip": 2}.get(name, ROW_EDIT_STEP)
        skipped = 1 if name == "rows skip" else None
        for step in range(STEPS):
            updates, rows = _expected_with_rows(mesh, step, edit_at, skipped)
            for res in results:
                s = res["position"][1]
                got = res[name]["steps"][step]
                where = f"{mesh} {name} rank {res['plan_rank']} step {step}"
                holds = {k for k in updates if infos[k].piece_numel(s)}
                assert set(got["applied"]) == holds, where
                for k in holds:
                    want = infos[k].cut(updates[k], s).view(got["applied"][k].shape)
                    assert torch.allclose(got["applied"][k], want, rtol=1e-6, atol=1e-5), f"{where}: matrix {k}"
                for k in range(len(SHAPES)):
                    p = infos[k].pieces[s]
                    assert torch.allclose(got["rows"][k], rows[k][p.row : p.row + p.rows], rtol=1e-6,
                                          atol=1e-5), f"{where}: matrix {k}'s row state"
            reports = _reports(results, name, step)
            assert all(rep["skipped_nonfinite"] == (step == skipped) for rep in reports), (name, step)
            if step == skipped:
                continue
            kept = {rep["blocks_exchanged_in_backward"] for rep in reports}
            # Editing the row state alone makes the edited matrix's launch stale on every rank.
            assert kept == {blocks - (1 if step == edit_at else 0)}, (name, step, kept)
