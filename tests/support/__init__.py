"""Helpers shared by the tests (not tests themselves): imported by conftest files and tests."""
