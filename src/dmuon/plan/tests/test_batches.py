"""NS batches as the balancer planned them, and the update-return waves built from them."""

import pytest

from dmuon.plan.batches import return_waves, split_into_batches


def test_planned_sizes_are_followed_per_kind():
    kind_of = ["a", "b", "a", "a", "b", "a", "a"]
    out = split_into_batches(range(7), kind_of, {"a": [4, 1], "b": [2]})
    assert out == [[0, 2, 3, 5], [6], [1, 4]]


def test_missing_matrices_shorten_the_last_batch_and_extras_form_one_more():
    kind_of = ["a"] * 6
    assert split_into_batches([0, 1, 2], kind_of, {"a": [2, 2]}) == [[0, 1], [2]]
    assert split_into_batches(range(6), kind_of, {"a": [2, 2]}) == [[0, 1], [2, 3], [4, 5]]
    assert split_into_batches(range(6), kind_of, {"a": [2]}) == [[0, 1], [2, 3, 4, 5]]


def test_unplanned_kinds_run_as_one_batch_and_nothing_is_lost():
    kind_of = [(3, 4), (3, 4), (5, 6)]
    out = split_into_batches([2, 0, 1], kind_of, {})
    assert out == [[2], [0, 1]]
    assert split_into_batches([], kind_of, {(3, 4): [1]}) == []


def test_wave_k_holds_every_owners_kth_batch_and_the_last_the_rest():
    batches = {0: [[0, 1], [4], [6], [8]], 1: [[2]], 3: [[3, 5], [7]]}
    assert return_waves(batches, ready=[9], max_waves=3) == [[0, 1, 2, 3, 5, 9], [4, 7], [6, 8]]
    assert return_waves(batches, ready=[], max_waves=1) == [[0, 1, 2, 3, 4, 5, 6, 7, 8]]


def test_empty_waves_are_kept_in_place_and_bad_counts_refused():
    assert return_waves({0: [[1]]}, ready=[], max_waves=3) == [[1], [], []]
    assert return_waves({}, ready=[2, 0], max_waves=2) == [[0, 2], []]
    with pytest.raises(ValueError, match="max_waves"):
        return_waves({}, ready=[], max_waves=0)
