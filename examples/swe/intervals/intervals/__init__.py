"""Closed integer intervals and their unions."""

from intervals.interval import Interval
from intervals.ops import gaps, merge, total_length

__all__ = ["Interval", "gaps", "merge", "total_length"]
