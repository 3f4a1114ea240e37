import pytest
from textkit import wrap


def test_wraps_at_word_boundaries():
    assert wrap("the quick brown fox", 9) == ["the quick", "brown fox"]


def test_long_word_gets_its_own_line():
    assert wrap("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]


def test_width_must_be_positive():
    with pytest.raises(ValueError):
        wrap("x", 0)
