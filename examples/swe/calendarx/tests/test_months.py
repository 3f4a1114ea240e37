import pytest
from calendarx import add_months, day_of_year, days_in_month


def test_days_in_month():
    lengths = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    assert [days_in_month(2023, month) for month in range(1, 13)] == lengths


def test_february_of_a_leap_year():
    assert days_in_month(2024, 2) == 29


def test_month_out_of_range():
    with pytest.raises(ValueError):
        days_in_month(2023, 13)


def test_add_months_clamps_the_day():
    assert add_months(2023, 1, 31, 1) == (2023, 2, 28)


def test_add_months_across_years():
    assert add_months(2023, 11, 15, 3) == (2024, 2, 15)


def test_day_of_year():
    assert day_of_year(2023, 3, 1) == 60
    assert day_of_year(2024, 12, 31) == 366
