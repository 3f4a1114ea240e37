"""Running a program on a code task's tests in a grading box, and judging each run.

Grading runs every test in a fresh sandbox (network off) under the time limit (wall clock,
interpreter start included) and the memory limit (address space). The box runs the test
harness (`harness/run_tests.py`, package data run by the box's interpreter), which runs each
test as a process of its own and reports its raw outcome; the expected outputs stay outside
the box, where `judge` compares them (`matching`). A stdin/stdout test passes when the
program exits 0 and its output matches; a function-call test (run by `harness/call_runner.py`)
when its return value does. Verdicts: pass, wrong answer, runtime error, time limit, memory
limit, and skipped (not run: after a failure when the reward is "all", or once the grading
time budget is spent).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

from sandbox.base import Limits, Sandbox, SandboxError, SandboxSpec
from sandbox.procs import explain_end
from sandbox.statedir import chown_tree
from workers.handlers.code.matching import outputs_match, values_match
from workers.handlers.code.records import CodeTask, StdioTest, TestCase
from workers.handlers.gradingbox import GradingPlace, grading_box

Verdict = Literal["pass", "wrong answer", "runtime error", "time limit", "memory limit", "skipped"]


def _program(name: str) -> str:
    """The text of a program that runs in the box (the package's `harness/` data)."""
    return (files("workers.handlers.code") / "harness" / name).read_text(encoding="utf-8")


HARNESS = _program("run_tests.py")
"""Run in the box as `python -S -I -c HARNESS`: the plan as JSON on stdin, a line per test
started and per test done on stdout."""
CALL_RUNNER = _program("call_runner.py")
"""Run by the harness for each function-call test, as `python -I -c CALL_RUNNER ...`."""

PROGRAM_INSIDE = "/workspace/solution.py"
TESTS_INSIDE = "/workspace/tests"
MIN_OUTPUT_CAP = 64 << 10
"""Bytes of output (or of a JSON return value) always kept; more when the expected is longer."""
FILE_SIZE_LIMIT = 64 << 20
"""Largest file a program under test may write, stdout and stderr included."""
PROCESS_LIMIT = 64
"""Processes and threads of one grading box at a time."""
PER_TEST_SLACK = 3.0
"""Seconds allowed per test beyond its time limit: cleaning up after it, and reporting."""
RUN_SLACK = 10.0
"""Seconds allowed per harness run for starting the box and the harness."""
HARNESS_MEMORY = 256 << 20
"""Address space of the harness beyond the outputs it holds."""

# Extra environment of the programs under test: BLAS pools of one thread, so that numpy
# stays inside the address-space limit.
PROGRAM_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class TestResult:
    """How one test went."""

    index: int
    kind: Literal["stdio", "call"]
    verdict: Verdict
    seconds: float | None = None
    message: str = ""
    """A short excerpt: the difference, the error's last lines, or why the test did not run."""

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"test": self.index, "kind": self.kind, "verdict": self.verdict}
        if self.seconds is not None:
            data["seconds"] = self.seconds
        if self.message:
            data["message"] = self.message
        return data


def _excerpt(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _error_excerpt(stderr: str, limit: int = 300) -> str:
    """The end of a traceback: its last few lines, where the exception is named."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    text = "\n".join(lines[-3:])
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]


def _output_cap(test: TestCase) -> int:
    if isinstance(test, StdioTest):
        size = len(test.output.encode())
    else:
        size = max(len(json.dumps(value)) for value in test.expected)
    return max(MIN_OUTPUT_CAP, 2 * size + 4096)


def judge(test: TestCase, index: int, record: dict[str, Any]) -> TestResult:
    """The verdict on one test from the harness's raw record of its run."""
    kind: Literal["stdio", "call"] = "stdio" if isinstance(test, StdioTest) else "call"
    seconds = float(record.get("seconds", 0.0))
    returncode = int(record.get("returncode", 1))
    timed_out = bool(record.get("timed_out"))
    stderr = str(record.get("stderr") or "")

    def result(verdict: Verdict, message: str = "") -> TestResult:
        return TestResult(index, kind, verdict, seconds, message)

    limit = explain_end(returncode, stderr, timed_out) if returncode != 0 or timed_out else None
    if timed_out or limit == "cpu_seconds":
        return result("time limit")
    if limit == "memory_bytes":
        return result("memory limit", _error_excerpt(stderr))
    if returncode != 0:
        reasons = {"processes": "process limit reached", "file_size_bytes": "output too large"}
        why = reasons.get(limit or "") or (f"killed by {limit}" if limit else "")
        message = _error_excerpt(stderr) or f"exit status {returncode}"
        return result("runtime error", f"{why}: {message}" if why else message)
    if isinstance(test, StdioTest):
        if record.get("stdout_cut"):
            return result("wrong answer", "output longer than the grader keeps")
        got = str(record.get("stdout") or "")
        if outputs_match(got, test.output):
            return result("pass")
        return result("wrong answer", f"got {_excerpt(got)!r}, expected {_excerpt(test.output)!r}")
    if record.get("result") is None:
        return result("runtime error", "the function returned no result (the program exited)")
    if record.get("result_cut"):
        return result("wrong answer", "return value longer than the grader keeps")
    try:
        value = json.loads(str(record["result"]))
    except ValueError:
        return result("runtime error", "the return value is not JSON")
    if any(values_match(value, expected) for expected in test.expected):
        return result("pass")
    return result(
        "wrong answer",
        f"got {_excerpt(json.dumps(value))}, expected {_excerpt(json.dumps(test.expected[0]))}",
    )


def run_tests(
    program: str,
    task: CodeTask,
    place: GradingPlace,
    *,
    job_id: str,
    budget_seconds: float,
    stop_at_first_failure: bool,
) -> list[TestResult]:
    """Run `program` on every test of `task` in a fresh sandbox labelled with `job_id`; one
    result per test, in order.

    The box has no network, and each test runs as its own process under the task's time and
    memory limits. A test that hangs, blows its memory or kills the grader fails alone;
    the others are still run. With `stop_at_first_failure`, tests after the first one that
    fails to exit cleanly are skipped. Everything ends within about `budget_seconds`, tests
    not reached by then are skipped, and the box is always stopped.
    """
    deadline = time.monotonic() + budget_seconds
    caps = [_output_cap(test) for test in task.tests]
    file_size = max(FILE_SIZE_LIMIT, *caps)
    # The box's limits bind the harness; each program gets the task's own (lower) ones.
    limits = Limits(
        cpu_seconds=math.ceil(budget_seconds) + 10,
        memory_bytes=(task.memory_mb << 20) + 8 * max(caps) + HARNESS_MEMORY,
        processes=PROCESS_LIMIT,
        file_size_bytes=file_size,
    )
    spec = SandboxSpec(
        job_id=job_id,
        network=False,
        limits=limits,
        lease_seconds=budget_seconds + 120.0,
    )
    results: dict[int, TestResult] = {}
    budget_spent = False
    with grading_box(spec, place, setup=lambda box: _write_inputs(box, program, task)) as box:
        pending = list(range(len(task.tests)))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining < min(task.time_limit, 1.0):
                budget_spent = True
                break
            ran = _harness_run(box, task, pending, caps, remaining, stop_at_first_failure)
            results.update(ran)
            failed = any(r.verdict != "pass" for r in ran.values())
            pending = [i for i in pending if i not in ran]
            if stop_at_first_failure and failed:
                break
    for index, test in enumerate(task.tests):
        if index not in results:
            kind: Literal["stdio", "call"] = "stdio" if isinstance(test, StdioTest) else "call"
            why = "the grading time budget was spent" if budget_spent else "an earlier test failed"
            results[index] = TestResult(index, kind, "skipped", message=why)
    return [results[i] for i in range(len(task.tests))]


def _write_inputs(box: Sandbox, program: str, task: CodeTask) -> None:
    """Put the program and the test inputs in the box's workspace, read-only to the box."""
    workspace = box.workspace
    (workspace / "solution.py").write_text(program, encoding="utf-8")
    tests_dir = workspace / "tests"
    tests_dir.mkdir()
    for index, test in enumerate(task.tests):
        data = test.input if isinstance(test, StdioTest) else json.dumps(test.args)
        (tests_dir / f"{index}.in").write_text(data, encoding="utf-8")
    if os.geteuid() == 0:
        # As root the box runs under a uid of its own that was given the workspace; taking
        # it back leaves the program nothing on the host's disk to write to.
        chown_tree(workspace, 0, 0)


def _harness_run(
    box: Sandbox,
    task: CodeTask,
    pending: list[int],
    caps: list[int],
    remaining: float,
    stop_at_first_failure: bool,
) -> dict[int, TestResult]:
    """One run of the harness over `pending`: the results of the tests it finished, and of
    the one it was running when it died (a grader killed by its test fails that test).

    Raises SandboxError when the harness did not get as far as starting a test: no program
    had run yet, so the fault is the grader's, not the answer's.
    """
    plan = {
        "python": sys.executable,
        "program": PROGRAM_INSIDE,
        "call_runner": CALL_RUNNER,
        "time_limit": task.time_limit,
        "memory_bytes": task.memory_mb << 20,
        "file_size_bytes": max(FILE_SIZE_LIMIT, *caps),
        "env": PROGRAM_ENV,
        "sweep": box.backend == "bwrap",
        "stop_on_error": stop_at_first_failure,
        "tests": [
            {
                "index": i,
                "kind": "stdio" if isinstance(task.tests[i], StdioTest) else "call",
                "fn_name": getattr(task.tests[i], "fn_name", None),
                "input": f"{TESTS_INSIDE}/{i}.in",
                "cap": caps[i],
            }
            for i in pending
        ],
    }
    timeout = min(remaining, len(pending) * (task.time_limit + PER_TEST_SLACK) + RUN_SLACK)
    output_room = sum(6 * caps[i] + 8192 for i in pending) + (1 << 20)
    outcome = box.exec(
        [sys.executable, "-S", "-I", "-c", HARNESS],
        timeout=timeout,
        input=json.dumps(plan).encode(),
        max_output=output_room,
    )
    results: dict[int, TestResult] = {}
    running: int | None = None
    started = False
    for line in outcome.stdout.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if not isinstance(record, dict):
                continue
            if "start" in record:
                running = int(record["start"])
                started = True
            elif "done" in record:
                index = int(record["done"])
                results[index] = judge(task.tests[index], index, record)
                running = None
    if not started:
        raise SandboxError(
            f"the grading harness did not start (exit status {outcome.returncode}): "
            f"{_error_excerpt(outcome.stderr) or '(no output)'}"
        )
    if running is not None and running not in results:
        kind: Literal["stdio", "call"] = (
            "stdio" if isinstance(task.tests[running], StdioTest) else "call"
        )
        if outcome.timed_out:
            results[running] = TestResult(
                running, kind, "time limit", message="the grader timed out"
            )
        else:
            why = outcome.killed_by or f"exit status {outcome.returncode}"
            results[running] = TestResult(
                running, kind, "runtime error", message=f"the test stopped the grader ({why})"
            )
    return results
