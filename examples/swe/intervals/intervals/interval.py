"""One closed interval [start, end]."""

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    """The integers from `start` to `end`, both included; ordered by start, then end."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"interval ends before it starts: [{self.start}, {self.end}]")

    @property
    def length(self) -> int:
        return self.end - self.start

    def overlaps(self, other: "Interval") -> bool:
        """True when the two intervals share a point (touching ones do)."""
        return self.start <= other.end and other.start <= self.end
