"""What dmuon tells about itself: the ``dmuon`` logger (a NullHandler; the setup's summary at INFO on rank 0)
and the profiler ranges ``dmuon.<phase>``, found in a Chrome trace of a 2-rank step, each nested where it runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

import dmuon
from dmuon.plan.cost_table import CostTable
from dmuon.util import observe
from support.cases import sharded_oddnet
from support.models import lm_loss, odd_batch
from support.spawn import run_distributed


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))


# ----------------------------------------------------------------------------------------------- logs

def test_the_logger_prints_nothing_unless_the_application_configures_logging():
    """A NullHandler, as libraries do: a warning on the ``dmuon`` logger and a whole setup print nothing."""
    code = ("import logging, torch, dmuon\n"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))\n"
            "opt = dmuon.DMuon(m, lr=0.02, ns=dmuon.NSConfig(method='standard', batching='looped'))\n"
            "m(torch.ones(2, 4)).sum().backward(); opt.step()\n"
            "logging.getLogger('dmuon').warning('not shown')\n"
            "print('handlers', [type(h).__name__ for h in logging.getLogger('dmuon').handlers])\n")
    src = os.path.dirname(os.path.dirname(dmuon.__file__))  # the dmuon under test, installed or not
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "handlers ['NullHandler']"
    assert done.stderr == ""


def test_setup_logs_matrices_owners_balance_predicted_ns_and_tuning(caplog):
    """One process, measured costs (a table of seconds): the plan's matrices and owners, the balance, the
    predicted NS time as the table's sum (one owner), and the tuning (method="auto": every batch tuned)."""
    model = _small_model()
    shapes = [(16, 8), (12, 16), (4, 12)]
    seconds = {(16, 8): 0.002, (12, 16): 0.003, (4, 12): 0.0005}
    table = CostTable({(s, 1): seconds[s] for s in shapes}, unit="seconds", source="file")
    plan = dmuon.prepare(model, cost_table=table)
    with caplog.at_level(logging.INFO, logger="dmuon"):
        dmuon.DMuon(model, plan, lr=0.02)
    messages = [r.getMessage() for r in caplog.records if r.name == "dmuon" and r.levelno == logging.INFO]
    assert len(messages) == 2, messages
    table_text, summary = messages
    for name in ("0.weight", "2.weight", "4.weight"):
        assert name in table_text
    assert "3 Muon matrices on 1 ranks" in summary
    assert "balance (largest owner's cost over the mean) 1.000" in summary
    assert f"{sum(seconds.values()) * 1e3:.3g} ms on the slowest owner (measured costs)" in summary
    assert "NS batches tuned on rank 0 in" in summary


def test_setup_names_fixed_ns_and_flop_costs(caplog):
    """The analytical model predicts FLOPs, not time (the log says so), and a fixed NS tunes nothing."""
    model = _small_model()
    with caplog.at_level(logging.INFO, logger="dmuon"):
        opt = dmuon.DMuon(model, lr=0.02, ns=dmuon.NSConfig(method="standard", batching="looped"))
    summary = [r.getMessage() for r in caplog.records if "dmuon setup" in r.getMessage()]
    assert len(summary) == 1
    flops = sum(info.cost for info in opt.plan.infos)
    assert f"{flops / 1e9:.3g} GFLOP on the slowest owner (the analytical model predicts no time" in summary[0]
    assert "no NS tuning (method=standard, batching=looped fixed)" in summary[0]


def _setup_logs(rank: int, world_size: int) -> dict:
    records = _Records()
    log = logging.getLogger("dmuon")
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        _, plan, _ = sharded_oddnet(world_size, balancer="greedy")
    finally:
        log.removeHandler(records)
    loads = [0.0] * world_size
    for info in plan.infos:
        loads[info.owner] += info.cost
    return {"messages": records.messages, "owners": {i.name: i.owner for i in plan.infos}, "loads": loads}


def test_two_ranks_only_rank0_logs_and_its_balance_is_the_largest_owner_over_the_mean():
    results = run_distributed(_setup_logs, 2, timeout_s=240)
    assert results[1]["messages"] == []
    messages = [m for level, m in results[0]["messages"] if level == logging.INFO]
    table_text, summary = messages
    for name, owner in results[0]["owners"].items():
        row = next(line for line in table_text.splitlines() if line.startswith(name + " "))
        assert row.split()[2] == str(owner), row
    loads = results[0]["loads"]
    assert f"balance (largest owner's cost over the mean) {max(loads) / (sum(loads) / 2):.3f}" in summary
    assert "on 2 ranks" in summary


# ------------------------------------------------------------------------------------ profiler ranges

def test_no_range_is_entered_while_no_profiler_records(monkeypatch):
    """No profiler: a whole step enters no ``record_function`` (each would cost microseconds)."""
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) entered with no profiler running")

    monkeypatch.setattr(observe, "record_function", refuse)
    model = _small_model()
    opt = dmuon.DMuon(model, lr=0.02, ns=dmuon.NSConfig(method="standard", batching="looped"))
    for _ in range(2):
        model(torch.ones(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert observe.phase("x") is observe.phase("y")  # the one shared do-nothing context


def test_ranges_are_recorded_while_a_profiler_records():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with observe.phase("unit.test"):
            pass
        observe.ranged("unit.decorated")(lambda: None)()
    names = {e.name for e in prof.events()}
    assert {"dmuon.unit.test", "dmuon.unit.decorated"} <= names


CASES = {
    "1-D": dict(mesh_shape=None),
    "replicate-level-next-forward": dict(mesh_shape=(2, 1), hsdp="dmuon",
                                         execution=dict(apply_updates="next_forward")),
    "ns-in-backward": dict(mesh_shape=None, execution=dict(ns_in_backward=True, returns_in_backward=True)),
}


def _profiled_step(rank: int, world_size: int, case: str) -> list[dict]:
    kw = dict(CASES[case])
    execution = dmuon.ExecutionConfig(**kw.pop("execution", {}))
    model, _, opt = sharded_oddnet(world_size, execution=execution, **kw)
    lm_loss(model, odd_batch(0, rank)).backward()  # a first step: momenta exist, nothing tunes later
    opt.step()
    opt.zero_grad()
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)  # the NS worker's thread too
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        for step in (1, 2):
            with record_function("test.forward"):
                loss = lm_loss(model, odd_batch(step, rank))
            if step == 2:
                break  # the second forward: the first step's updates applied there (next_forward)
            with record_function("test.backward"):
                loss.backward()
            with record_function("test.step"):
                opt.step()
            opt.zero_grad()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"trace{rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [{k: e[k] for k in ("name", "tid", "ts", "dur")} for e in events
            if e.get("ph") == "X" and (e["name"].startswith("dmuon.") or e["name"].startswith("test."))]


@pytest.fixture(scope="module")
def traces() -> dict[str, list[list[dict]]]:
    return {case: run_distributed(_profiled_step, 2, case, timeout_s=300) for case in CASES}


def _within(e: dict, o: dict) -> bool:
    return o["tid"] == e["tid"] and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]


def _inside(events: list[dict], name: str, *outer: str) -> list[dict]:
    """Every ``name`` range, each checked to lie inside a range named one of ``outer``, on its thread."""
    found = [e for e in events if e["name"] == name]
    assert found, f"no {name} range in the trace"
    outers = [e for e in events if e["name"] in outer]
    for e in found:
        assert any(_within(e, o) for o in outers), f"a {name} range outside {outer}"
    return found


def _some_inside(events: list[dict], name: str, outer: str) -> None:
    """At least one ``name`` range inside an ``outer`` range, on its thread."""
    outers = [e for e in events if e["name"] == outer]
    assert any(_within(e, o) for e in events if e["name"] == name for o in outers), f"no {name} inside {outer}"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_2_rank_1d_step_shows_every_phase_where_it_runs(traces, rank):
    events = traces["1-D"][rank]
    _inside(events, "dmuon.launch", "test.backward")           # the launch, in FSDP2's backward hook
    _inside(events, "dmuon.directions.hop_b", "dmuon.launch")  # the exchange to the owners
    _inside(events, "dmuon.step", "test.step")
    for phase in ("dmuon.settle", "dmuon.ns.batch", "dmuon.returns.hop_1", "dmuon.apply", "dmuon.adamw",
                  "dmuon.land"):
        _inside(events, phase, "dmuon.step")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_replicate_level_and_next_forward_show_their_phases(traces, rank):
    events = traces["replicate-level-next-forward"][rank]
    _inside(events, "dmuon.replicate.reduce_columns", "dmuon.launch")
    _inside(events, "dmuon.launch", "test.backward", "dmuon.step")  # the last unit's: in step()'s take()
    _some_inside(events, "dmuon.launch", "test.backward")
    # Hop A in row chunks over the following launches, the rest when step() takes them.
    _inside(events, "dmuon.directions.hop_a", "test.backward", "dmuon.step")
    _some_inside(events, "dmuon.directions.hop_a", "dmuon.launch")
    _some_inside(events, "dmuon.replicate.land", "test.backward")  # every reduction lands in backward
    _inside(events, "dmuon.returns.hop_2", "dmuon.step")
    applied = _inside(events, "dmuon.next_forward.apply", "test.forward")
    # The one applied in the second forward: after the step.
    step_end = max(e["ts"] + e["dur"] for e in events if e["name"] == "test.step")
    assert any(e["ts"] > step_end for e in applied)
    assert not [e for e in events if e["name"] == "dmuon.apply"]  # nothing applied inside step()


@pytest.mark.parametrize("rank", [0, 1])
def test_ns_in_backward_runs_on_the_worker_thread(traces, rank):
    events = traces["ns-in-backward"][rank]
    main = {e["tid"] for e in events if e["name"] == "test.backward"}
    workers = _inside(events, "dmuon.ns.batch", "dmuon.ns.worker")
    assert {e["tid"] for e in workers}.isdisjoint(main)  # not on the thread that ran backward
    _inside(events, "dmuon.launch", "test.backward")
