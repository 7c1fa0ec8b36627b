"""The live planner owns each expert slice on a rank that holds it, wherever the balancer's per-rank counts
allow (dmuon.plan.holders): on torchtitan's layout with whole experts per rank (tests/support/moe.py's
"ep2-dim0": E = 4 over ep 2 x efsdp 2), training still equals one process with torch.optim.Muon per slice,
and the bytes each rank moves are still the step model's for that plan."""

from __future__ import annotations

import functools

from support import moe
from support.scenarios import run_each, succeeded
from support.spawn import run_distributed

from dmuon.plan.holders import holder_ranks

STEPS = 2


def _ranks(rank: int, world: int) -> dict:
    # One process group: the fp32 run is compared with the reference, the bf16-wire one's collectives counted.
    return run_each({"fp32": functools.partial(moe.train, rank, world, "ep2-dim0", STEPS),
                     "counted": functools.partial(moe.train, rank, world, "ep2-dim0", STEPS, counted=True)})


@functools.cache
def _results() -> dict[str, list[dict]]:
    runs = run_distributed(_ranks, 4, timeout_s=300)
    return {name: [succeeded(r[name]) for r in runs] for name in ("fp32", "counted")}


def test_slices_owned_by_their_holders_and_training_equals_one_process():
    results = _results()
    fp32, counted = results["fp32"], results["counted"]
    first = counted[0]
    owners = [o for _, o, _ in first["infos"]]
    assert fp32[0]["owners"] == counted[0]["owners"]  # one plan, whatever the NS dtype
    holders = holder_ranks(first["pieces"], first["replicate"], first["shard"])
    shapes = [shape for shape, _, _ in first["infos"]]
    names = list(fp32[0]["owners"])
    slices = [i for i, n in enumerate(names) if ".experts." in n]
    # Whole experts: one holder per slice. Held by fewer ranks too: shared_up's 6 rows over 4 positions (2, 2, 2, 0).
    assert len(slices) == 2 * 2 * 4 and all(len(holders[i]) == 1 for i in slices)
    assert {names[i] for i, h in enumerate(holders) if h is not None} - {names[i] for i in slices} == \
        {"layers.0.shared_up.weight", "layers.1.shared_up.weight"}
    # A matrix off its holders only where each holder's room for the kind (the shape) is taken by ones it holds.
    for i, h in enumerate(holders):
        if h is None or owners[i] in h:
            continue
        for j, shape in enumerate(shapes):
            if shape == shapes[i] and owners[j] in h:
                assert holders[j] is not None and owners[j] in holders[j], (names[i], names[j], owners)
    # The balancer gives each rank 2 slices of each shape, and each rank holds 2 of each: all on their holders.
    assert all(owners[i] in holders[i] for i in slices), owners
    ref = moe.reference(fp32[0]["initial"], STEPS, 4, 4)
    name = max(ref, key=lambda n: (fp32[0]["params"][n] - ref[n]).abs().max().item())
    err = (fp32[0]["params"][name] - ref[name]).abs().max().item()
    assert err <= 1e-5, (name, err)
    assert sum(r["orthogonalized"] for r in fp32) == len(owners)  # NS once per matrix in the cluster


def test_counted_bytes_equal_the_step_model_with_owners_on_holders():
    from dmuon.costmodel.traffic import owner_exchange_collectives

    results = _results()["counted"]
    first = results[0]
    shapes, owners, blocks = ([i[k] for i in first["infos"]] for k in range(3))
    backward, step = owner_exchange_collectives(shapes, owners, blocks, first["replicate"], first["shard"], 2,
                                                waves=first["waves"], pieces=first["pieces"])
    for r in results:
        k = r["plan_rank"]
        expected = [(c.level, *c.ranks[k]) for c in backward + step if c.ranks[k] is not None]
        assert r["log"] == expected, f"plan rank {k}"
