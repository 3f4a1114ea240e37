"""Handlers check at submission every field they use later; the helpers that make input safe to
store and to echo back."""

from __future__ import annotations

from typing import Any

import pytest

from api.errors import json_safe
from core.schemas import json_problem
from workers.handlers.base import TaskValidationError
from workers.handlers.code.records import MAX_MEMORY_MB, MAX_TIME_LIMIT, read_task
from workers.handlers.shell import MAX_TIMEOUT, ShellHandler, check_timeout, task_files

SHELL = {"data_source": "shell", "instruction": "make x", "check": "test -f /workspace/x"}
CODE = {"data_source": "code", "problem": "Echo.", "tests": [{"input": "1", "output": "1"}]}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def call(self, tool: str, **args: Any) -> dict[str, Any]:
        self.calls.append({"tool": tool, **args})
        return {"exit_code": 0}


def test_shell_files_are_written_where_their_normalised_paths_point() -> None:
    task = {**SHELL, "files": {"/workspace/a/../b.txt": "1", "//workspace/c/./d": "2"}}
    ShellHandler().validate(task)
    tools = Recorder()
    ShellHandler().prepare(task, tools)
    assert [c["path"] for c in tools.calls] == ["/workspace/b.txt", "/workspace/c/d"]


@pytest.mark.parametrize(
    "files",
    [
        {"/workspace/../etc/passwd": "x"},
        {"/workspace": "x"},
        {"workspace/x": "x"},
        {"/workspacex/y": "x"},
        {"/workspace/a\x00b": "x"},
        {"/workspace/" + "n" * 256: "x"},
        {"/workspace/a": "1", "/workspace/b/../a": "2"},
        {"/workspace/a": "1", "/workspace/a/b/c": "2"},
        {"/workspace/a": None},
        ["/workspace/a"],
    ],
)
def test_shell_files_that_would_fail_in_the_sandbox_are_refused(files: Any) -> None:
    with pytest.raises(TaskValidationError) as refused:
        ShellHandler().validate({**SHELL, "files": files})
    assert refused.value.field == "files"


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 60.0), (5, 5.0), (0.5, 0.5), (MAX_TIMEOUT, MAX_TIMEOUT)]
)
def test_shell_timeout_is_read_once_and_used_by_grading(value: Any, expected: float) -> None:
    task = {**SHELL, "timeout": value}
    ShellHandler().validate(task)
    assert check_timeout(task) == expected
    tools = Recorder()
    ShellHandler().grade(task, [], tools, job_id="job-1")
    assert tools.calls[0]["timeout"] == expected


@pytest.mark.parametrize("value", ["x", True, 0, -1, float("nan"), float("inf"), 10**400, [5]])
def test_shell_timeout_of_the_wrong_type_or_range_is_refused(value: Any) -> None:
    with pytest.raises(TaskValidationError) as refused:
        ShellHandler().validate({**SHELL, "timeout": value})
    assert refused.value.field == "timeout"


def test_shell_files_may_be_absent_or_null() -> None:
    assert task_files(SHELL) == {}
    assert task_files({**SHELL, "files": None}) == {}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"time_limit": 10**400}, "time_limit"),
        ({"time_limit": MAX_TIME_LIMIT + 1}, "time_limit"),
        ({"time_limit": {"seconds": 10**400}}, "time_limit.seconds"),
        ({"memory_limit_mb": MAX_MEMORY_MB + 1}, "memory_limit_mb"),
        ({"memory_limit_bytes": 10**400}, "memory_limit_bytes"),
        ({"tests": "[" * 3000 + "]" * 3000}, "tests"),
        ({"tests": '[{"input": "\\udc00", "output": ""}]'}, "tests"),
        ({"tests": [{"fn_name": "f", "args": [], "expected": 1, "testtype": "functional"}]}, None),
    ],
)
def test_code_limits_and_json_text_are_checked_at_submission(
    extra: dict[str, Any], field: str | None
) -> None:
    if field is None:
        read_task({**CODE, **extra})
        return
    with pytest.raises(TaskValidationError) as refused:
        read_task({**CODE, **extra})
    assert refused.value.field == field


def test_code_json_text_may_hold_infinities() -> None:
    task = {**CODE, "tests": '[{"fn_name": "f", "args": [], "expected": Infinity}]'}
    assert read_task(task).tests[0].expected == [float("inf")]  # type: ignore[union-attr]


def test_json_problem_finds_the_first_bad_place() -> None:
    assert json_problem({"a": [1, 2.5, "ok", {"b": None}]}) is None
    assert json_problem({"a": [1, float("nan")]}) == (["a", 1], "must be a finite number, not nan")
    assert json_problem({"a": [1, float("inf")]}, allow_nonfinite=True) is None
    path, message = json_problem({"a": {"b": "x\ud800"}}) or ([], "")
    assert path == ["a", "b"] and "surrogate" in message
    path, message = json_problem({"k": {"\udfff": 1}}) or ([], "")
    assert path == ["k", "\\udfff"] and "key" in message
    deep: Any = 0
    for _ in range(10):
        deep = [deep]
    assert json_problem(deep, max_depth=10) is None
    assert json_problem([deep], max_depth=10) is not None


def test_json_safe_makes_anything_strict_json() -> None:
    value = {"n": float("nan"), "i": float("-inf"), "s": "a\ud800", "b": b"\xff", "o": object}
    safe = json_safe(value)
    assert safe["n"] == "nan" and safe["i"] == "-inf"
    assert safe["s"] == "a\\ud800" and safe["b"] == "\\xff"
    assert safe["o"] == str(object)
    assert json_safe("x" * 5000, max_chars=10) == "x" * 10 + "…"
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    assert "…" in str(json_safe(deep))
