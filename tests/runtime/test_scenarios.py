"""support.scenarios: a scenario that raises fails on its own, with its text; the ranks never deadlock."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmuon.testing.stream_check import StreamOrderError
from support.cases import Case, run_cases
from support.scenarios import ScenarioFailed, run_each
from support.spawn import run_distributed

# Its point is stream order (a checker error ending every rank): every rank runs under the stream checker.
pytestmark = pytest.mark.streams


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _raise_on(ranks: tuple[int, ...]) -> float:
    """Raises on ``ranks``; the others go on into a collective that the raising ranks never issue."""
    if dist.get_rank() in ranks:
        raise ValueError(f"injected on rank {dist.get_rank()}")
    return _sum_of_ranks()


def _three_scenarios(rank: int, world_size: int, ranks: tuple[int, ...]) -> dict:
    return run_each({"before": _sum_of_ranks, "raises": lambda: _raise_on(ranks), "after": _sum_of_ranks})


def test_a_scenario_that_raises_on_every_rank_fails_alone():
    for out in run_distributed(_three_scenarios, 2, (0, 1), timeout_s=30):
        assert out["before"] == out["after"] == 1.0
        failed = out["raises"]
        assert isinstance(failed, ScenarioFailed)
        assert "raised on 2 of 2 ranks" in failed["error"]
        assert "ValueError: injected on rank 0" in failed["error"]
        assert "ValueError: injected on rank 1" in failed["error"]
        # A test reading the scenario's values fails with the text.
        with pytest.raises(AssertionError, match="injected on rank 1"):
            failed["params"]


def test_a_scenario_that_raises_on_one_rank_does_not_hang_the_others():
    """Rank 0 waits in an all_reduce that rank 1 never issues: it times out (the group's 5 s), and the ranks
    stop together, the run failing with rank 1's error instead of hanging."""
    with pytest.raises(mp.ProcessRaisedException) as info:
        run_distributed(_three_scenarios, 2, (1,), timeout_s=5)
    message = str(info.value)
    assert "scenario 'raises' raised on 2 of 2 ranks" in message and "ValueError: injected on rank 1" in message
    assert "the run cannot go on" in message


def _checker_error_on_rank_1(rank: int, world_size: int) -> dict:
    def unordered() -> float:
        if dist.get_rank() == 1:  # as an error of a hook reaches backward's caller: the checker's as its cause
            try:
                raise StreamOrderError("injected hand-over with no event")
            except StreamOrderError as exc:
                raise RuntimeError("a hook failed") from exc
        return _sum_of_ranks()

    return run_each({"before": _sum_of_ranks, "unordered": unordered, "after": _sum_of_ranks})


def test_a_stream_checker_error_ends_every_rank_at_once():
    """Rank 0 waits in an all_reduce that rank 1, whose scenario hit the stream checker, never issues: no
    agreement waits for the group's timeout (300 s here); the run fails with the checker's error now."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="injected hand-over with no event"):
        run_distributed(_checker_error_on_rank_1, 2, timeout_s=300)
    elapsed = time.monotonic() - start
    assert elapsed < 120, f"the run took {elapsed:.0f} s to fail"


def test_a_case_that_raises_fails_only_its_own_assertions():
    cases = [Case(steps=1), Case(steps=1, ns_method="no such method"), Case(steps=1, kind="gather")]
    results = run_distributed(run_cases, 2, cases, timeout_s=120)
    good, bad, oracle = results[0]
    # The cases around the failed one ran in full: dmuon equals the gather-then-compute oracle.
    assert good["losses"] == pytest.approx(oracle["losses"], rel=1e-5) and len(good["losses"]) == 1
    for name, value in oracle["params"].items():
        assert torch.allclose(good["params"][name], value, atol=1e-5), name
    assert "no such method" in bad["error"]
    with pytest.raises(AssertionError, match="no such method"):
        bad["losses"]
