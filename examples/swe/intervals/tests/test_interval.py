import pytest
from intervals import Interval


def test_length():
    assert Interval(2, 7).length == 5


def test_reversed_interval_is_rejected():
    with pytest.raises(ValueError):
        Interval(3, 1)


def test_touching_intervals_overlap():
    assert Interval(1, 3).overlaps(Interval(3, 5))
