from intervals import Interval, gaps, merge, total_length


def test_merge_overlapping():
    assert merge([Interval(1, 3), Interval(2, 6)]) == [Interval(1, 6)]


def test_merge_keeps_disjoint_intervals():
    assert merge([Interval(1, 2), Interval(4, 5)]) == [Interval(1, 2), Interval(4, 5)]


def test_merge_of_nothing():
    assert merge([]) == []


def test_total_length():
    assert total_length([Interval(1, 3), Interval(2, 6), Interval(8, 9)]) == 6


def test_gaps():
    assert gaps([Interval(1, 2), Interval(5, 6), Interval(9, 9)]) == [
        Interval(2, 5),
        Interval(6, 9),
    ]
