"""The GPU check's ``runtimes`` section: its rows run for real on CPU (gloo, loopback collectives, the stream
checker) and pass against torch's pair; the verdicts fail each fault a GPU run could show; two faults made for
real (dmuon's collectives left out, the kept launches exchanged again) fail their rows."""

from __future__ import annotations

import copy
import functools
import json

import torch

from dmuon.bench import gpu_check
from dmuon.bench import gpu_check_runtimes as gr
from dmuon.bench.gpu_check_base import one_rank

CPU = torch.device("cpu")


def test_the_rows_pass_on_cpu_against_torchs_pair(tmp_path):
    """Each row on one gloo rank with loopback collectives (every rank's streams under the checker, conftest.py):
    DMuon(ddp) issues the agreement and the updates' all-gather each step; the one-stage schedule's launches
    from its reduction stand from the second step; fp16 with GradScaler keeps its launches rescaled and skips
    the inf's step; each equals torch.optim.Muon + AdamW in the same process within the row's tolerance."""
    out = tmp_path / "runtimes.json"
    payload = gr.runtimes_section(CPU, str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))  # the JSON holds every row
    assert payload["backend"] == "gloo" and [r["row"] for r in payload["rows"]] == list(gr.ROWS)
    assert not [r for r in payload["rows"] if "error" in r], payload["rows"]
    checks = gpu_check.collect_checks({"runtimes": {**payload, "wall_s": 1.0}})
    assert len(checks) == 1 + len(gr.ROWS)
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    rows = {r["row"]: r for r in payload["rows"]}
    # One agreement and one all-gather per step, exactly: what the DDP runtime issues on one rank with loopback.
    assert rows["ddp"]["collectives"] == {"all_reduce": gr.STEPS, gr.all_gather_name(): gr.STEPS}
    assert [s["launches"] for s in rows["fp16"]["steps"] if "launches" in s] == [
        [0, 0], [gr.BLOCKS] * 2, [gr.BLOCKS] * 2, [0, 0], [gr.BLOCKS] * 2]


def test_a_row_fails_where_dmuon_issues_no_collectives_or_exchanges_kept_launches_again(monkeypatch):
    """Made for real: DMuon(ddp) without loopback (one rank hands everything over: what a runtime ignoring
    ``loopback_collectives`` does) fails the DDP row, its weights still equal; fp16 with ``clipped_overlap=False``
    (every rescaled launch exchanged again in ``step()``) fails the fp16 row on its launches alone."""
    with one_rank(CPU):
        monkeypatch.setattr(gr, "make_dmuon", functools.partial(gr.make_dmuon, loopback_collectives=False))
        local = gr.ddp_run(CPU)
        monkeypatch.setattr(gr, "make_dmuon", functools.partial(gr.make_dmuon, clipped_overlap=False))
        redone = gr.fp16_run(CPU)
    assert local["collectives"] == {} and local["max_diff"] <= gr.TOLERANCE
    assert not gr.VERDICTS["ddp"](local)[0]
    assert all(s["max_diff"] <= gr.TOLERANCE for s in redone["steps"] if not s["skipped"])
    passed, detail = gr.VERDICTS["fp16"](redone)
    assert not passed and "[0, 0], [0, 0], [0, 0], None" in detail, detail


def _failing(payload: dict) -> set[str]:
    return {c["name"].split(":")[0] for c in gr.runtimes_verdicts(payload) if not c["passed"]}


def _passing() -> dict:
    payload = gr.fake_payload()
    payload["rows"][1]["launches"][-1] = [gr.BLOCKS, 0]  # the made-up stale launch, set right
    return payload


def _with(change) -> dict:
    payload = copy.deepcopy(_passing())
    change({r["row"]: r for r in payload["rows"]})
    return payload


def test_the_verdicts_fail_each_fault():
    assert _failing(_passing()) == set()
    assert _failing(gr.fake_payload()) == {"runtimes pipeline"}
    faults = {
        "ddp": [lambda r: r["ddp"].update(collectives={"all_reduce": gr.STEPS}),  # no all-gather: updates local
                lambda r: r["ddp"].update(max_diff=3e-3),  # an update lost or doubled
                lambda r: r["ddp"].update(runtime="Runtime"),  # not DDP's runtime
                lambda r: r["ddp"]["orthogonalized"].__setitem__(2, 5)],  # a matrix left out of a step
        "pipeline": [lambda r: r["pipeline"]["launches"].__setitem__(0, [gr.BLOCKS, 0]),  # launched undivided
                     lambda r: r["pipeline"]["launches"].__setitem__(2, [gr.BLOCKS, gr.BLOCKS]),  # rescaled
                     lambda r: r["pipeline"].update(collectives={"all_reduce": 1}),  # no exchange on the group
                     lambda r: r["pipeline"].update(max_diff=1e-4)],
        "fp16": [lambda r: r["fp16"]["steps"][2].update(launches=[0, 0]),  # a kept launch exchanged again
                 lambda r: r["fp16"]["steps"][gr.INF_STEP].update(unchanged=False),  # the skipped step moved
                 lambda r: r["fp16"]["steps"][gr.INF_STEP].update(skipped=False),  # the inf not skipped
                 lambda r: r["fp16"]["steps"][4].update(scale=gr.FP16_SCALE),  # not torch's scaler's scale
                 lambda r: r["fp16"]["steps"][5].update(max_diff=2e-5)],
    }
    for row, changes in faults.items():
        for change in changes:
            assert _failing(_with(change)) == {f"runtimes {row}"}, (row, change)
    missing = _passing()
    missing["rows"] = missing["rows"][:1]  # a timeout after the first row
    assert _failing(missing) == {"runtimes pipeline", "runtimes fp16"}
    raised = _passing()
    raised["rows"][2] = {"row": "fp16", "error": "RuntimeError: made-up"}
    (fp16,) = [c for c in gr.runtimes_verdicts(raised) if not c["passed"]]
    assert fp16["detail"] == "RuntimeError: made-up"


def test_every_row_states_what_it_checks_and_fits_the_budget():
    names = [c["name"] for c in gr.runtimes_verdicts(_passing())]
    assert [n.split(":")[0] for n in names] == [f"runtimes {row}" for row in gr.ROWS]
    assert all("torch's Muon + AdamW" in n for n in names)
    assert "runtimes" in gpu_check.SECTIONS and gpu_check.SECTIONS[-1] == "ns"
    assert gpu_check.budget()["total_s"] <= gpu_check.BUDGET_S == 480
    _, env = gpu_check.section_command("runtimes", "x.json")
    assert env["CUBLAS_WORKSPACE_CONFIG"] == gpu_check.DETERMINISM_ENV["CUBLAS_WORKSPACE_CONFIG"]
    assert gr.fp16_launches([False, True, False, False], 3) == [[0, 0], None, [0, 0], [3, 3]]


def test_the_reference_is_torchs_muon_iterating_in_fp32(monkeypatch):
    """The oracle is torch.optim.Muon on the blocks' matrices, AdamW on the rest, its iteration in fp32 inside
    the step only: left in bf16 (the patch off) its weights differ from it by more than the rows' tolerance."""
    import contextlib

    import torch.optim._muon as torch_muon

    original = torch_muon._zeropower_via_newtonschulz
    fp32 = gr.reference(CPU, 2)
    assert torch_muon._zeropower_via_newtonschulz is original
    monkeypatch.setattr(gr, "fp32_torch_muon", contextlib.nullcontext)
    assert gr.max_diff(gr.reference(CPU, 2), fp32)[0] > 10 * gr.TOLERANCE
    pair = gr.TorchPair(gr.row_net(CPU))
    assert len(pair.muon.param_groups[0]["params"]) == 2 * gr.BLOCKS
