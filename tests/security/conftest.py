"""The escape suite's pipeline tests use the end-to-end stack fixtures."""

from tests.e2e.conftest import client, run_pool, stack

__all__ = ["client", "run_pool", "stack"]
