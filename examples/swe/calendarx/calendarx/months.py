"""Month lengths and month arithmetic."""

from calendarx.leap import is_leap

_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def days_in_month(year: int, month: int) -> int:
    """The number of days of `month` (1 to 12) in `year`."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be in 1..12, not {month}")
    if month == 2 and is_leap(year):
        return 29
    return _DAYS[month - 1]


def add_months(year: int, month: int, day: int, months: int) -> tuple[int, int, int]:
    """The date `months` months after `year`-`month`-`day`, as (year, month, day).

    The day is clamped to the length of the month it lands in.
    """
    new_year, index = divmod(year * 12 + month - 1 + months, 12)
    new_month = index + 1
    return new_year, new_month, min(day, days_in_month(new_year, new_month))


def day_of_year(year: int, month: int, day: int) -> int:
    """The position of the date in its year, from 1."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day
