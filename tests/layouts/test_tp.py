"""Tensor parallelism: torch's ``parallelize_module`` on the ``tp`` dim of a (dp, tp) or
(replicate, shard, tp) mesh, then FSDP2 over dp. Each Muon matrix's owner assembles it from
every shard (colwise rows inside TP's chunks, rowwise boxes, copies of a matrix TP leaves whole)
and the result is single-process torch.optim.Muon's whatever the TP degree."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import dmuon
from support.spawn import run_distributed

from support.scenarios import run_each, succeeded
from support.tp import BLOCKS, HIDDEN, MATRICES, WIDTH, TPNet, check_equals_reference, reference, train

# Its point is stream order (TP's pieces launched from backward and returned in it): the ranks of dmuon's fp32
# runs run under the stream checker. The bf16 mixed-precision pair and the gather-then-compute oracle (whose
# point is what they compute) share a 4-rank run of their own without it.
STREAMS = pytest.mark.streams

STEPS = 3
MESHES = {"dp2-tp2": (2, 2), "hsdp2x2-tp2": (2, 2, 2)}


UNCHECKED = (("dp2-tp2", "gather"), ("bf16", "dmuon"), ("bf16", "gather"))
"""The 4-rank runs whose ranks run without the stream checker (see STREAMS)."""


def _on_four(rank: int, world: int, checked: bool) -> dict:
    """Every 4-rank run of this file under the stream checker (``checked``) or not, in one process group (a
    spawn costs more than the work), each with its own result or its own error."""
    from support.tp import counted_tp_step

    shape = MESHES["dp2-tp2"]
    runs = {
        ("dp2-tp2", "dmuon"): lambda: train(rank, world, STEPS, shape, "dmuon"),
        ("dp2-tp2", "gather"): lambda: train(rank, world, STEPS, shape, "gather"),
        ("dp2-tp2", "counted"): lambda: counted_tp_step(rank, world, shape),
        "sequence parallel": lambda: train(rank, world, STEPS, shape, "dmuon", True),
        ("bf16", "dmuon"): lambda: train(rank, world, STEPS, shape, "dmuon", False, True),
        ("bf16", "gather"): lambda: train(rank, world, STEPS, shape, "gather", False, True),
        ("clip", "overlap"): lambda: train(rank, world, STEPS, shape, "dmuon", clip=CLIP),
        ("clip", "off"): lambda: train(rank, world, STEPS, shape, "dmuon", clip=CLIP, overlap=False),
        ("dp2-tp2", "returns in backward"): lambda: train(
            rank, world, STEPS, shape, "dmuon",
            execution=dmuon.ExecutionConfig(ns_in_backward=True, returns_in_backward=True))}
    return run_each({key: run for key, run in runs.items() if (key in UNCHECKED) != checked})


def _on_eight(rank: int, world: int, checkpoint: str) -> dict:
    """Every 8-rank run of this file in one process group."""
    from support.tp import counted_tp_step, resume_matches_continuing

    shape = MESHES["hsdp2x2-tp2"]
    return run_each({("hsdp2x2-tp2", "dmuon"): lambda: train(rank, world, STEPS, shape, "dmuon"),
                     ("hsdp2x2-tp2", "counted"): lambda: counted_tp_step(rank, world, shape),
                     "resume": lambda: resume_matches_continuing(rank, world, shape, checkpoint)})


@functools.cache
def _four(checked: bool = True) -> list[dict]:
    return run_distributed(_on_four, 4, checked, timeout_s=300)


@functools.cache
def _eight() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        return run_distributed(_on_eight, 8, f"{directory}/ckpt", timeout_s=300)


def _ranks(runs: list[dict], key) -> list[dict]:
    """Each rank's result of the run ``key`` (its ranks' error when it raised)."""
    return [succeeded(r[key]) for r in runs]


def _run(mesh: str, what: str = "dmuon") -> list[dict]:
    """Every rank's result of one run (``mesh``: a key of MESHES, or ``"bf16"``: dp2-tp2 in bf16)."""
    return _ranks(_eight() if mesh == "hsdp2x2-tp2" else _four((mesh, what) not in UNCHECKED), (mesh, what))


def _worst(got: dict, ref: dict) -> tuple[str, float]:
    name = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return name, (got[name] - ref[name]).abs().max().item()


@STREAMS
@pytest.mark.parametrize("mesh", MESHES)
def test_tp_fsdp_equals_single_process_torch_muon(mesh):
    results = _run(mesh)
    # One process's result, one NS per matrix over the whole mesh, owners spread over every rank.
    check_equals_reference(results, len(results) // MESHES[mesh][-1], STEPS)
    assert len({results[0]["owners"][n] for n in MATRICES}) == min(len(MATRICES), len(results))
    assert all(r["owners"] == results[0]["owners"] for r in results)


@STREAMS
@pytest.mark.parametrize("mesh", MESHES)
def test_momentum_is_held_once_except_for_tp_copies(mesh):
    results = _run(mesh)
    tp = MESHES[mesh][-1]
    for n in MATRICES:
        numel = results[0]["params"][n].numel()
        held = sum(r["momentum_numel"][n] for r in results)
        # TP leaves ``mix`` whole: each tp rank keeps a copy (as it does of the weight and of AdamW's state).
        assert held == numel * (tp if ".mix." in n else 1), (n, held, numel)


@STREAMS
def test_pieces_follow_torchs_layouts():
    pieces = _run("dp2-tp2")[0]["pieces"]
    # Positions s = dp * 2 + tp. Colwise: TP's row chunk (5 rows each), FSDP2's 3 + 2 rows inside it.
    assert [(p.row, p.rows, p.col, p.cols) for p in pieces["layers.0.up.weight"]] == \
        [(0, 3, 0, WIDTH), (5, 3, 0, WIDTH), (3, 2, 0, WIDTH), (8, 2, 0, WIDTH)]
    # Rowwise: FSDP2's rows (4 + 3) x TP's columns (5 + 5).
    assert [(p.row, p.rows, p.col, p.cols) for p in pieces["layers.0.down.weight"]] == \
        [(0, 4, 0, 5), (0, 4, 5, 5), (4, 3, 0, 5), (4, 3, 5, 5)]
    # Left whole by TP: each tp rank holds FSDP2's rows; the first of each pair sends them.
    mix = pieces["layers.0.mix.weight"]
    assert [(p.row, p.rows, p.sends) for p in mix] == [(0, 4, True), (0, 4, False), (4, 3, True), (4, 3, False)]
    assert HIDDEN == 10 and BLOCKS == 2


def test_gather_then_compute_on_the_same_tp_model_agrees():
    """The oracle on the same DTensors (full_tensor of each gradient, the update written back shard by shard)."""
    got, oracle = _run("dp2-tp2")[0]["params"], _run("dp2-tp2", "gather")[0]["params"]
    name, err = _worst(got, oracle)
    assert err <= 1e-6, (name, err)


@STREAMS
@pytest.mark.parametrize("mesh", MESHES)
def test_counted_collectives_equal_the_traffic_model_with_pieces(mesh):
    from dmuon.costmodel.traffic import owner_exchange_collectives

    results = _run(mesh, "counted")
    first = results[0]
    shapes, owners, blocks = ([i[k] for i in first["infos"]] for k in range(3))
    assert all(r["blocks_in_backward"] == BLOCKS for r in results)  # the two layers (the root has no matrix)
    backward, step = owner_exchange_collectives(shapes, owners, blocks, first["replicate"], first["shard"], 2,
                                                waves=first["waves"], pieces=first["pieces"])
    for r in results:
        k = r["plan_rank"]
        expected = [(c.level, *c.ranks[k]) for c in backward + step if c.ranks[k] is not None]
        assert r["log"] == expected, f"{mesh} plan rank {k}"
    assert any(c.critical for c in backward) and all(c.critical for c in step)


@STREAMS
def test_sequence_parallel_norms_and_embedding():
    """SequenceParallel norms, a rowwise embedding and colwise head around the blocks: the residual
    stream split over the sequence; the matrices' result is still single-process torch.optim.Muon's."""
    results = _ranks(_four(), "sequence parallel")
    check_equals_reference(results, 2, STEPS, sequence_parallel=True)


@STREAMS
def test_dcp_checkpoint_resumes_exactly_on_hsdp_tp():
    """get_model/optimizer_state_dict + dcp.save/load + set_*: the rowwise momentum's columns are split
    over the replicas inside TP's split (_StridedShard), and the resumed run continues bit for bit."""
    got = _ranks(_eight(), "resume")[0]
    assert "_StridedShard(dim=1, sf=2)" in got["placements"], got["placements"]
    for name, value in got["continued"].items():
        assert torch.equal(got["resumed"][name], value), name


def test_bf16_mixed_precision_equals_gather_then_compute_on_the_same_tp_model():
    """MixedPrecisionPolicy(bf16 params, fp32 reductions) on every fully_shard of the TP model: dmuon
    against the oracle on the same DTensors (both orthogonalize the same fp32 gradients)."""
    got, oracle = _run("bf16", "dmuon")[0], _run("bf16", "gather")[0]
    name, err = _worst(got["params"], oracle["params"])
    assert err <= 1e-5, (name, err)
    torch.manual_seed(0)
    start = dict(TPNet().named_parameters())
    assert all(not torch.equal(got["params"][n], start[n].detach()) for n in MATRICES)


def test_tiling_check_catches_gaps_overlaps_and_bounds():
    """prepare's check that the distinct pieces cover each matrix exactly once (what proves them contiguous)."""
    from dmuon.prepare.pieces import tiles as _tiles

    rowwise = {(0, 4, 0, 5), (0, 4, 5, 5), (4, 3, 0, 5), (4, 3, 5, 5)}
    assert _tiles(rowwise, 7, 10) and _tiles({(0, 3, 0, 7), (3, 4, 0, 7)}, 7, 7)
    assert not _tiles({(0, 4, 0, 5), (0, 4, 4, 6), (4, 3, 0, 5), (4, 3, 5, 5)}, 7, 10)  # overlap
    assert not _tiles({(0, 3, 0, 7)}, 7, 7)  # gap
    assert not _tiles({(0, 8, 0, 7)}, 7, 7)  # past the last row
    # Strided rows {0, 2} and {1, 3} seen as boxes from their first row overlap: caught.
    assert not _tiles({(0, 2, 0, 4), (1, 2, 0, 4)}, 4, 4)
    assert _tiles({(k * 7, 7, 0, 50) for k in range(1024)}, 7168, 50)


CLIP = 1e-3  # below every gradient norm of TPNet here: every step clips


@STREAMS
def test_launches_survive_clipping_under_tensor_parallelism():
    """``DMuon.clip_grad_norm_`` on the (dp, tp) mesh every step: from the second clipped step on every
    block's launch stands for the clipped gradients (the owners rescale), and the result is
    ``overlap=False``'s within float32 rounding (fp32 NS)."""
    clipped, off = _run("clip", "overlap"), _run("clip", "off")
    for r, r_off in zip(clipped, off):
        # The first clip exchanges again and starts the owners' copies; then every launch stands.
        kept = [launch[:2] for launch in r["launches"]]
        blocks = kept[-1][0]
        assert blocks > 0 and kept == [(0, 0)] + [(blocks, blocks)] * (STEPS - 1), kept
        assert all(k[:2] == (0, 0) for k in r_off["launches"])
    got, want = clipped[0]["params"], off[0]["params"]
    assert max((got[n] - want[n]).abs().max().item() for n in want) <= 1e-6


@STREAMS
def test_returns_in_backward_under_tensor_parallelism():
    """``returns_in_backward`` on a (dp, tp) mesh: TP's pieces and copies come back in backward for the
    blocks launched first, and the parameters are the single-process reference's."""
    results = _run("dp2-tp2", "returns in backward")
    params, _ = reference(2, STEPS)
    name, err = _worst(results[0]["params"], params)
    assert err <= 1e-5, (name, err)
    returned = [[launch[2] for launch in r["launches"]] for r in results]
    assert all(per_rank == returned[0] for per_rank in returned)
    assert all(0 < n < launched for n, (launched, _, _) in zip(returned[0], results[0]["launches"]))
