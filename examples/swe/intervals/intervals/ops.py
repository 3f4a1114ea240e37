"""Unions of intervals."""

from collections.abc import Iterable
from itertools import pairwise

from intervals.interval import Interval


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as disjoint intervals in ascending order.

    Overlapping and touching intervals are joined into one.
    """
    merged: list[Interval] = []
    for current in intervals:
        if merged and merged[-1].overlaps(current):
            last = merged.pop()
            merged.append(Interval(last.start, max(last.end, current.end)))
        else:
            merged.append(current)
    return merged


def total_length(intervals: Iterable[Interval]) -> int:
    """The length of the union of `intervals`."""
    return sum(interval.length for interval in merge(intervals))


def gaps(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals between the parts of the union of `intervals`."""
    parts = merge(intervals)
    return [Interval(left.end, right.start) for left, right in pairwise(parts)]
