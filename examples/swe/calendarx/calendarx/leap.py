"""Leap years."""


def is_leap(year: int) -> bool:
    """True when `year` is a leap year of the Gregorian calendar."""
    return year % 4 == 0
