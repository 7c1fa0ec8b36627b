from dmuon.plan.batches import split_into_batches


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
