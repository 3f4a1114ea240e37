"""Gregorian calendar arithmetic without `datetime`."""

from calendarx.leap import is_leap
from calendarx.months import add_months, day_of_year, days_in_month

__all__ = ["add_months", "day_of_year", "days_in_month", "is_leap"]
