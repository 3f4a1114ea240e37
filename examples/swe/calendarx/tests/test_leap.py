from calendarx import is_leap


def test_every_fourth_year_is_leap():
    assert is_leap(2024)
    assert is_leap(1996)


def test_other_years_are_common():
    assert not is_leap(2023)
    assert not is_leap(2019)
