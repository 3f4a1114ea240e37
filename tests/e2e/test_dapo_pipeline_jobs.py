"""Dynamic sampling and batch cancellation with a many-jobs RUN worker (`--jobs N`): the tests
of `test_dapo_pipeline` again, where stopping a running job cancels its task on the worker's
event loop (Celery's revoke reaches it through `workers.jobpool`) instead of killing a
process, and its sandbox and backend slot must still be freed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_dapo_pipeline as prefork
from tests.e2e.test_dapo_pipeline import (
    test_a_dynamic_batch_returns_exactly_the_target_and_stops_the_rest,
    test_cancelling_a_plain_batch_stops_its_running_jobs_and_frees_their_boxes,
    test_sandboxed_groups_cancelled_at_the_target_leave_no_box,
)

pytestmark = pytest.mark.full

__all__ = [
    "test_a_dynamic_batch_returns_exactly_the_target_and_stops_the_rest",
    "test_cancelling_a_plain_batch_stops_its_running_jobs_and_frees_their_boxes",
    "test_sandboxed_groups_cancelled_at_the_target_leave_no_box",
]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {**prefork.stack_settings(request, data), "run_jobs": 6}
