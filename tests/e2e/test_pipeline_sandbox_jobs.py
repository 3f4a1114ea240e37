"""Tool calls in bubblewrap boxes with a many-jobs RUN worker (`--jobs N`): the tests of
`test_pipeline_sandbox` again, the tools called over each box's socket from the worker's one
event loop, a cancelled job's box reaped without its process being killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_pipeline_sandbox as prefork
from tests.e2e.test_pipeline_sandbox import (
    test_a_cancelled_jobs_sandbox_is_reaped,
    test_a_command_that_never_ends_is_interrupted_by_the_tool_timeout,
    test_a_malformed_call_is_an_error_observation_and_counted,
    test_a_sample_that_does_not_do_the_task_gets_no_reward,
    test_an_agent_that_never_finishes_stops_at_max_turns,
    test_files_of_the_task_are_in_the_workspace_for_the_editor,
    test_tool_calls_run_in_the_sandbox_and_the_check_grades_it,
)

__all__ = [
    "test_a_cancelled_jobs_sandbox_is_reaped",
    "test_a_command_that_never_ends_is_interrupted_by_the_tool_timeout",
    "test_a_malformed_call_is_an_error_observation_and_counted",
    "test_a_sample_that_does_not_do_the_task_gets_no_reward",
    "test_an_agent_that_never_finishes_stops_at_max_turns",
    "test_files_of_the_task_are_in_the_workspace_for_the_editor",
    "test_tool_calls_run_in_the_sandbox_and_the_check_grades_it",
]

pytestmark = [prefork.pytestmark, pytest.mark.full]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {**prefork.stack_settings(request, data), "run_jobs": 8}
