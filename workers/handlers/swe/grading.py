"""Grading a `swe` patch as SWE-bench's harness does, in a fresh grading box.

The box clones the repository at `base_commit`, applies the model's patch (each of swebench's
`GIT_APPLY_CMDS` in turn), then runs the eval script (the test files reset, the test patch
applied, the tests run between swebench's markers); swebench's own parser and grading
functions grade its log (`grade_log`). See `evaluate`.
"""

from __future__ import annotations

import re
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.base import ExecResult, Sandbox
from workers.handlers.base import Grade, TaskValidationError
from workers.handlers.gradingbox import GradingPlace, grading_box
from workers.handlers.swe.runnerfiles import (
    GRADER_GIT_ENV,
    RunnerFilesError,
    restore_git_dir,
    restore_runner_files,
    snapshot_git_dir,
)
from workers.handlers.swe.task import SweEnvironmentError, SweTask, box_spec, checkout_script

LOG_TAIL = 4000
"""Characters of the test log kept in the grade's details."""
HEREDOC = "EOF_114329324912"
"""The delimiter SWE-bench's eval scripts put around the test patch."""


def test_targets(task: SweTask) -> list[str]:
    """What the test command is given: the files of the test patch but data and docs (as
    SWE-bench's `get_test_directives`, with Django's module names), then the file of any
    listed pytest test (`path::name`) not among them."""
    from swebench.harness.constants import NON_TEST_EXTS

    directives = re.findall(r"diff --git a/.* b/(.*)", task.test_patch)
    directives = [d for d in directives if not any(d.endswith(ext) for ext in NON_TEST_EXTS)]
    if task.repo == "django/django":
        modules = []
        for directive in directives:
            name = directive.removesuffix(".py").removeprefix("tests/")
            modules.append(name.replace("/", "."))
        return modules
    for test in [*task.fail_to_pass, *task.pass_to_pass]:
        if "::" in test:
            path = test.split("::", 1)[0]
            if path not in directives:
                directives.append(path)
    return directives


def eval_script(task: SweTask) -> list[str]:
    """The eval script's lines, as SWE-bench's for Python repositories: reset the test
    files to `base_commit`, apply the test patch, run the tests between the start and end
    markers, record the test command's exit status after the end marker."""
    from swebench.harness.constants import (
        END_TEST_OUTPUT,
        START_TEST_OUTPUT,
        TEST_EXIT_CODE,
        TEST_EXIT_CODE_VAR,
    )
    from swebench.utils import get_modified_files

    test_files = " ".join(shlex.quote(f) for f in get_modified_files(task.test_patch))
    directives = " ".join(shlex.quote(d) for d in test_targets(task))
    lines = [
        "git status",
        f"git -c core.fileMode=false diff {task.base_commit}",
    ]
    if test_files:
        lines.append(f"git checkout {task.base_commit} {test_files}")
    if task.test_patch.strip():
        lines.append(f"git apply -v - <<'{HEREDOC}'\n{task.test_patch}\n{HEREDOC}")
    lines += [
        f": '{START_TEST_OUTPUT}'",
        f"{task.test_cmd} {directives}".rstrip(),
        f"{TEST_EXIT_CODE_VAR}=$?",
        f": '{END_TEST_OUTPUT}'",
        f'echo "{TEST_EXIT_CODE}: ${TEST_EXIT_CODE_VAR}"',
    ]
    return lines


def _eval_type(task: SweTask) -> str:
    from swebench.harness.constants import FAIL_ONLY_REPOS, EvalType

    if task.eval_type:
        return task.eval_type
    return (EvalType.FAIL_ONLY if task.repo in FAIL_ONLY_REPOS else EvalType.PASS_AND_FAIL).value


def swebench_spec(task: SweTask) -> Any:
    """The task as swebench's `TestSpec`, which its grading functions read."""
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.types import TestSpec

    if task.log_parser not in PARSER_REGISTRY:
        raise TaskValidationError("log_parser", f"swebench has no parser {task.log_parser!r}")
    return TestSpec(
        instance_id=task.instance_id,
        image=task.image or "",
        eval_script_list=eval_script(task),
        repo=task.repo,
        version=task.version,
        FAIL_TO_PASS=task.fail_to_pass,
        PASS_TO_PASS=task.pass_to_pass,
        log_parser=task.log_parser,
        eval_type=_eval_type(task),
    )


@dataclass
class EvalReport:
    """How a test log grades."""

    resolution: str
    """swebench's `ResolvedStatus` value: RESOLVED_FULL, RESOLVED_PARTIAL or RESOLVED_NO."""
    parsed: bool
    """The log held gradable results (swebench's `get_logs_eval` found them)."""
    status: dict[str, str]
    """Test name -> PASSED, FAILED, ERROR, SKIPPED or XFAIL, as parsed."""
    tests: dict[str, dict[str, list[str]]]
    """FAIL_TO_PASS and PASS_TO_PASS, each {"success": [...], "failure": [...]}."""
    exit_code: int | None
    """The test command's exit status, as the log records it."""
    not_reported: list[str]
    """Tests the task names that the log says nothing of (counted as failures)."""

    @property
    def resolved(self) -> bool:
        return self.parsed and self.resolution == "RESOLVED_FULL"


def _reports_passes(task: SweTask) -> bool:
    """Whether the task's log parser names passing tests too (swebench's Python parsers
    do), so that a test missing from its log was not run."""
    from swebench.harness.constants import EvalType
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY

    python = {parser.__name__ for parser in MAP_REPO_TO_PARSER_PY.values()}
    return _eval_type(task) == EvalType.PASS_AND_FAIL.value or task.log_parser in python


def _fail_unreported(task: SweTask, status: dict[str, str], report: dict[str, Any]) -> list[str]:
    """Move every named test the log does not report from `report`'s successes to its
    failures (a run that collected fewer tests than the task names does not pass the
    others); the tests moved or already failed for that reason."""
    from swebench.harness import grading

    # swebench's own lookup, which tolerates its data's truncated parametrised ids.
    resolve = getattr(grading, "_resolve_case", None)

    def reported(test: str) -> bool:
        return resolve(test, status) is not None if resolve is not None else test in status

    missing: list[str] = []
    if not _reports_passes(task):
        return missing
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        for test in list(report[key]["success"]) + list(report[key]["failure"]):
            if not reported(test):
                missing.append(test)
                if test in report[key]["success"]:
                    report[key]["success"].remove(test)
                    report[key]["failure"].append(test)
    return missing


def grade_log(task: SweTask, log: str) -> EvalReport:
    """Grade an eval log exactly as SWE-bench's `get_eval_report` does: `get_logs_eval`
    (the task's parser on the text between the markers, the infrastructure checks), then
    `get_eval_tests_report` and `get_resolution_status`; but a test the task names and the
    log does not report fails whatever the eval type, when the task's parser reports passing
    tests too (`_fail_unreported`), and a log without gradable results is never resolved."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, EvalType
    from swebench.harness.grading import (
        get_eval_tests_report,
        get_logs_eval,
        get_resolution_status,
        parse_test_exit_code,
    )

    spec = swebench_spec(task)
    # get_logs_eval reads the log from a file, as the harness writes it.
    with tempfile.TemporaryDirectory(prefix="swe-log-") as directory:
        path = Path(directory) / "test_output.txt"
        path.write_text(log, encoding="utf-8")
        status, parsed = get_logs_eval(spec, str(path))
    gold = {
        "instance_id": task.instance_id,
        FAIL_TO_PASS: task.fail_to_pass,
        PASS_TO_PASS: task.pass_to_pass,
    }
    report = get_eval_tests_report(status, gold, eval_type=EvalType(spec.eval_type))
    not_reported = _fail_unreported(task, dict(status), report)
    return EvalReport(
        resolution=get_resolution_status(report),
        parsed=parsed,
        status=dict(status),
        tests={key: report[key] for key in (FAIL_TO_PASS, PASS_TO_PASS)},
        exit_code=parse_test_exit_code(log),
        not_reported=not_reported,
    )


@dataclass
class PatchApplied:
    """How applying the model's patch went."""

    applied: bool
    attempts: list[dict[str, Any]]
    """Each command tried, in order: {"command", "exit_code", "output"}."""

    @property
    def why_not(self) -> str:
        """The errors of the first command that gave any (but those introducing a quote),
        else the last line any command printed."""
        for attempt in self.attempts:
            errors = [
                line.removeprefix("error:").strip()
                for line in attempt["output"].splitlines()
                if line.startswith("error:") and not line.endswith(":")
            ]
            if errors:
                return "; ".join(errors)
        lines = [line for a in self.attempts for line in a["output"].splitlines() if line]
        return lines[-1] if lines else "no command could apply it"


def text_tail(text: str, limit: int = LOG_TAIL) -> str:
    """The last `limit` characters of `text`, marked as cut when they are not all of it."""
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def _combined(result: ExecResult) -> str:
    return (result.stdout + result.stderr).strip()


class _Clock:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; raises TimeoutError once there are none."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left


def apply_patch(box: Sandbox, patch: str, clock: _Clock) -> PatchApplied:
    """Apply the model's patch in the box's workspace as SWE-bench's harness does: each of
    its `GIT_APPLY_CMDS` in turn from a pristine tree, then a check that the patch is
    not already in place."""
    from swebench.harness.constants import CONTAINER_PATCH_FILE
    from swebench.harness.run_evaluation import GIT_APPLY_CMDS

    data = patch.encode("utf-8")

    def run(command: str) -> ExecResult:
        # The box's /tmp lives as long as one exec: the patch file is written in the same one.
        script = f"cat > {CONTAINER_PATCH_FILE} && {command} {CONTAINER_PATCH_FILE}"
        return box.exec(["bash", "-c", script], input=data, env=GRADER_GIT_ENV,
                        timeout=clock.left())  # fmt: skip

    attempts: list[dict[str, Any]] = []

    def attempt(command: str) -> bool:
        result = run(command)
        output = text_tail(_combined(result), 1000)
        attempts.append({"command": command, "exit_code": result.returncode, "output": output})
        return result.returncode == 0

    for index, command in enumerate(GIT_APPLY_CMDS):
        if index:
            box.exec(["bash", "-c", "git checkout -- . ; git clean -fdq"], env=GRADER_GIT_ENV,
                     timeout=clock.left())  # fmt: skip
        if attempt(command):
            return PatchApplied(True, attempts)
    # The chain can leave the patch applied while every command failed.
    return PatchApplied(attempt("git apply --check --reverse"), attempts)


def _report_details(report: EvalReport) -> dict[str, Any]:
    return {
        "resolution": report.resolution,
        "log_parsed": report.parsed,
        "FAIL_TO_PASS": report.tests["FAIL_TO_PASS"],
        "PASS_TO_PASS": report.tests["PASS_TO_PASS"],
        "test_exit_code": report.exit_code,
        "not_reported": report.not_reported,
    }


def _verdict(report: EvalReport) -> str:
    if report.resolved:
        return "resolved: every FAIL_TO_PASS and PASS_TO_PASS test passes"
    if not report.parsed:
        return (
            "not resolved: the test log holds no gradable results (the tests did not run, "
            "or their command failed without reporting a failing test)"
        )
    failing = []
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        names = report.tests[key]["failure"]
        if names:
            failing.append(f"{key} failing: {', '.join(names)}")
    return f"not resolved ({report.resolution}): " + "; ".join(failing)


def evaluate(
    task: SweTask, patch: str, *, place: GradingPlace, job_id: str, timeout: float
) -> Grade:
    """Grade `patch` in a fresh box labelled with `job_id`, made at `place`: clone at
    `base_commit`, apply the patch (reward 0 when it does not apply), put the files that
    configure or hook the test runner back as `base_commit` has them
    (`workers.handlers.swe.runnerfiles`; listed in the details as `restored`), run the eval
    script, grade its log with swebench (`grade_log`). A host repository of `task` has passed
    `checked_on_worker`.

    Reward 1.0 only when swebench says RESOLVED_FULL. The whole takes at most `timeout`
    seconds (running out while the tests run scores 0); the box is always stopped. Raises
    `SweEnvironmentError` when the repository cannot be checked out.
    """
    clock = _Clock(timeout)
    started = time.monotonic()
    details: dict[str, Any] = {
        "instance_id": task.instance_id,
        "patch_applied": None,
        "patch_is_empty": not patch.strip(),
    }
    spec = box_spec(task, job_id, lease_seconds=timeout + 60)
    try:
        with grading_box(spec, place, start_timeout=min(60.0, clock.left())) as box:
            return _grade_in(box, task, patch, clock, details, started)
    except TimeoutError:
        details.update(timed_out=True, reason=f"grading took longer than {timeout:.0f}s")
        return _finish(details, 0.0, started)


def _grade_in(
    box: Sandbox,
    task: SweTask,
    patch: str,
    clock: _Clock,
    details: dict[str, Any],
    started: float,
) -> Grade:
    """`evaluate`'s work in its started box; raises TimeoutError once `clock` runs out."""
    checkout = box.exec(["bash", "-c", checkout_script(task)], timeout=clock.left())
    if checkout.returncode != 0:
        raise SweEnvironmentError(
            f"cannot check out {task.base_commit} of {task.source}: "
            f"{text_tail(_combined(checkout), 1000)}"
        )
    details["restored"] = []
    try:
        git_dir = snapshot_git_dir(box, clock.left())
    except RunnerFilesError as exc:
        raise SweEnvironmentError(str(exc)) from None
    if patch.strip():
        applied = apply_patch(box, patch, clock)
        details["patch_applied"] = applied.applied
        details["patch_apply"] = applied.attempts
        if not applied.applied:
            details.update(
                resolution="RESOLVED_NO",
                reason=f"the patch does not apply: {applied.why_not}",
                tests_ran=False,
                FAIL_TO_PASS={"success": [], "failure": task.fail_to_pass},
                PASS_TO_PASS={"success": [], "failure": task.pass_to_pass},
            )
            return _finish(details, 0.0, started)
    try:
        details["restored"] = restore_git_dir(box, git_dir, clock.left())
        details["restored"] += restore_runner_files(box, task.base_commit, clock.left())
    except RunnerFilesError as exc:
        details.update(resolution="RESOLVED_NO", tests_ran=False, reason=str(exc))
        return _finish(details, 0.0, started)
    script = "\n".join(["exec 2>&1", "set -uxo pipefail", *eval_script(task)]) + "\n"
    run = box.exec(
        ["bash", "-c", "cat > /tmp/eval.sh && exec bash /tmp/eval.sh"],
        input=script.encode("utf-8"),
        env=GRADER_GIT_ENV,
        timeout=clock.left(),
    )
    log = run.stdout + run.stderr
    report = grade_log(task, log)
    details.update(_report_details(report))
    details["log_tail"] = text_tail(log)
    if run.timed_out:
        details["timed_out"] = True
        details["reason"] = f"the tests did not finish within {clock.seconds:.0f}s"
        return _finish(details, 0.0, started)
    details["reason"] = _verdict(report)
    if not patch.strip():
        details["reason"] += " (the episode produced no patch: the repository is unchanged)"
    return _finish(details, 1.0 if report.resolved else 0.0, started)


def _finish(details: dict[str, Any], reward: float, started: float) -> Grade:
    details["seconds"] = round(time.monotonic() - started, 3)
    return Grade(reward=reward, details=details)
