"""`swe` tasks: SWE-bench instances, worked by an agent in a sandbox and graded by their tests.

A task is a SWE-bench instance record (`instance_id`, `repo`, `base_commit`,
`problem_statement`, `patch`, `test_patch`, `FAIL_TO_PASS`, `PASS_TO_PASS` as lists or as
JSON strings of lists, `version`) with `data_source: "swe"` and where its environment comes
from, `environment`:

- `{"repo_path": "/abs/path/to/a/git/repo", "python": "/abs/bin/python", "test_cmd": "..."}`
  for boxes on the host's root (bwrap): the repository is bound read-only into the box at
  `/rollserve/source` and cloned from there. `python` (default: the service's own
  interpreter, which has pytest) comes first on the box's PATH; `test_cmd` (default
  `<python> -m pytest -rA`) is followed by the test files to run.
- `{"image": "/abs/x.sif" or "docker://...", "repo_path": "/testbed", ...}` for boxes with
  a root of their own (apptainer): `repo_path` is then a path inside the image (default
  `/testbed`, as in the SWE-bench images).

Optional task fields: `timeout` (seconds for setting up and for grading; default the
`tool_timeout` setting), and, as in the SWE-bench 5 records, `log_parser` (a name of
swebench's `PARSER_REGISTRY`, default `parse_log_pytest`) and `eval_type`.

INIT clones the repository into `/workspace` at `base_commit`; RUN's outcome is the
`git diff` of the workspace against `base_commit`, new files included; EVAL applies that
patch and the test patch in a fresh box and grades the test log with swebench's own parser
and grading functions, as its harness does (see `evaluate`).

The agent can read the repository it is cloned from (`/rollserve/source`), so a repository
given as `repo_path` should hold no commit past `base_commit`.

Host repositories come only from the directories the operator names in
`ROLLSERVE_SWE_REPO_ROOTS` (none by default: such tasks are refused until it is set). A
`repo_path` is resolved (symlinks, `..`) before it is checked, at submission and again on
the worker, which binds the resolved path; below its root no component may be hidden (start
with `.`), and nothing is taken from `REFUSED_TREES` or the service's data and sandbox
directories, whatever the roots say.
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib
import json
import os
import re
import secrets
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from core.schemas import json_problem
from core.settings import get_settings
from sandbox.backends import get_backend
from sandbox.base import DEFAULT_PATH, WORKSPACE_INSIDE, Bind, ExecResult, Sandbox, SandboxSpec
from sandbox.reaper import reap
from workers.handlers.base import (
    Grade,
    Handler,
    StepResult,
    TaskValidationError,
    ToolSession,
    required_text,
)
from workers.tool_specs import ALL_TOOLS

SOURCE_INSIDE = "/rollserve/source"
"""Where a host repository (`environment.repo_path`) is bound in the box, read-only."""
IMAGE_REPO = "/testbed"
"""Where the repository is in an image when `environment.repo_path` does not say."""
GRADING_DIR = ".swe-grading"
"""Grading boxes' state root, inside the sandbox dir. Its leading dot keeps the workers'
reaper out: that reaper stops boxes whose job is not live, and a grading box belongs to
no job; `evaluate` sweeps this root itself."""
PATCH_CHUNK = 48_000
"""Bytes of the patch read per tool call (as base64, well under the tool output cap)."""
LOG_TAIL = 4000
"""Characters of the test log kept in the grade's details."""
HEREDOC = "EOF_114329324912"
"""The delimiter SWE-bench's eval scripts put around the test patch."""
OUTCOME_PATCH_FILE = "/tmp/rollserve-model.patch"

SYSTEM = """\
You are an autonomous software engineer working in a Linux sandbox. A git repository is \
checked out at /workspace; your bash shell starts there. Your job is to resolve the issue \
the user gives you by changing the repository's non-test files.

Work like this:
1. Find and read the code the issue is about.
2. Reproduce the problem (a short script or a test run with `python -m pytest`).
3. Edit the source code to fix it, keeping the change small and the style of the code.
4. Check that the problem is gone and that nothing else broke; think about edge cases.
5. Call `finish`.

Your change is taken as the `git diff` of /workspace against the original commit when you \
call `finish`; hidden tests then decide whether the issue is resolved. Use absolute paths \
with the editor. Do not stop until the issue is resolved.\
"""

USER = """\
<uploaded_files>
{workspace}
</uploaded_files>
The repository {repo} is checked out at {workspace}. Resolve this issue:

<issue_description>
{problem_statement}
</issue_description>

Make the smallest change to the non-test files of the repository that resolves the issue, \
then call finish.\
"""

REMINDER = (
    "Your last message called no tool. Keep working on the issue in /workspace with the tools "
    "(bash, editor, ipython), and call finish once the issue is resolved."
)

REFUSED_TREES = ("/proc", "/sys", "/dev", "/etc", "/boot", "/run", "/var/run")
"""Host trees no repository is taken from, whatever `ROLLSERVE_SWE_REPO_ROOTS` says."""

_COMMIT = re.compile(r"[0-9a-fA-F]{7,40}")
MAX_TIMEOUT = 3600.0
"""Longest `timeout` a task may give, in seconds."""
_EVAL_TYPES = ("pass_and_fail", "fail_only")


@functools.cache
def _parser_names() -> frozenset[str]:
    """The names in swebench's `PARSER_REGISTRY` (imported once, on first need: ~1 s)."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    return frozenset(PARSER_REGISTRY)


class SweEnvironmentError(RuntimeError):
    """The task's environment is unusable (the repository cannot be cloned or checked out);
    the job fails rather than scoring the model for it."""


# ----------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class SweTask:
    """A `swe` task as the handler uses it (see the module docstring)."""

    instance_id: str
    repo: str
    version: str
    base_commit: str
    problem_statement: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    source: str
    """Where the repository to clone is, as the box sees it."""
    host_repo: Path | None
    """The host repository bound into the box (None when it comes with the image)."""
    image: str | None
    python: str
    test_cmd: str
    log_parser: str
    eval_type: str
    timeout: float | None
    default_python: bool = field(default=False)
    """`python` is the service's interpreter rather than the task's."""


def _test_list(task: dict[str, Any], key: str, *, non_empty: bool) -> list[str]:
    value = task.get(key)
    if value is None:
        raise TaskValidationError(key, "is required")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise TaskValidationError(key, f"is a string but not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TaskValidationError(key, "must be a list of test names (or a JSON string of one)")
    if json_problem(value) is not None:
        raise TaskValidationError(key, "holds a test name that is not valid Unicode text")
    if non_empty and not value:
        raise TaskValidationError(key, "must name at least one test")
    return list(value)


def _absolute_path(environment: dict[str, Any], key: str) -> str | None:
    value = environment.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not os.path.isabs(value):
        raise TaskValidationError(f"environment.{key}", "must be an absolute path")
    return value


def allowed_repo_path(repo_path: Path | str) -> Path:
    """The real path of a host repository (symlinks and `..` resolved) when the policy
    allows it (see the module docstring); a `TaskValidationError` naming
    `environment.repo_path` otherwise. The message never shows where a symlink leads."""
    settings = get_settings()
    roots = settings.swe_repo_root_list
    name = "environment.repo_path"
    if not roots:
        raise TaskValidationError(
            name,
            "names a host repository, and none is allowed: set ROLLSERVE_SWE_REPO_ROOTS (on "
            "the gateway and the workers) to the directories repositories may come from",
        )
    real = Path(os.path.realpath(repo_path))
    root = next((r for r in roots if real.is_relative_to(r)), None)
    if root is None:
        raise TaskValidationError(
            name, "is not under a directory ROLLSERVE_SWE_REPO_ROOTS allows (once resolved)"
        )
    if any(part.startswith(".") for part in real.relative_to(root).parts):
        raise TaskValidationError(name, "is in a hidden directory (a name starting with .)")
    service_dirs = (settings.data_dir, settings.sandbox_dir)
    for tree in (*REFUSED_TREES, *(os.path.realpath(d) for d in service_dirs)):
        if real.is_relative_to(os.path.realpath(tree)):
            raise TaskValidationError(name, f"is in {tree}, which no repository is taken from")
    return real


def read_task(task: dict[str, Any]) -> SweTask:
    """The task's fields, checked; a `TaskValidationError` names the first bad one."""
    instance_id = required_text(task, "instance_id")
    repo = required_text(task, "repo")
    base_commit = required_text(task, "base_commit").strip()
    if not _COMMIT.fullmatch(base_commit):
        raise TaskValidationError("base_commit", "must be a commit hash (7 to 40 hex digits)")
    problem_statement = required_text(task, "problem_statement")
    version = task.get("version", "")
    if not isinstance(version, str | int | float) or isinstance(version, bool):
        raise TaskValidationError("version", "must be a string")
    test_patch = task.get("test_patch")
    if not isinstance(test_patch, str):
        raise TaskValidationError("test_patch", "must be a string (a unified diff)")
    if not isinstance(task.get("patch", ""), str):
        raise TaskValidationError("patch", "must be a string (a unified diff)")
    fail_to_pass = _test_list(task, "FAIL_TO_PASS", non_empty=True)
    pass_to_pass = _test_list(task, "PASS_TO_PASS", non_empty=False)

    environment = task.get("environment")
    if not isinstance(environment, dict):
        raise TaskValidationError(
            "environment", 'must be an object: {"repo_path": ...} or {"image": ...}'
        )
    image = environment.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise TaskValidationError("environment.image", "must be a non-empty string")
    if image is not None and (
        image.startswith("instance://")
        or not (os.path.isabs(image) or re.match(r"[a-z][a-z0-9+.-]*://.", image))
    ):
        raise TaskValidationError(
            "environment.image", "must be an absolute path or an image URI (docker://...)"
        )
    repo_path = _absolute_path(environment, "repo_path")
    if image is None and repo_path is None:
        raise TaskValidationError(
            "environment", "needs repo_path (a git repository on the host) or an image"
        )
    python = _absolute_path(environment, "python")
    test_cmd = environment.get("test_cmd")
    if test_cmd is not None and (not isinstance(test_cmd, str) or not test_cmd.strip()):
        raise TaskValidationError("environment.test_cmd", "must be a non-empty string")

    timeout = task.get("timeout")
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0
    ):
        raise TaskValidationError("timeout", "must be a positive number of seconds")
    if timeout is not None and not timeout <= MAX_TIMEOUT:
        raise TaskValidationError("timeout", f"must be at most {MAX_TIMEOUT:g} seconds")
    log_parser = task.get("log_parser") or "parse_log_pytest"
    if not isinstance(log_parser, str) or not log_parser.startswith("parse_log_"):
        raise TaskValidationError("log_parser", "must name a swebench log parser (parse_log_*)")
    if log_parser != "parse_log_pytest" and log_parser not in _parser_names():
        raise TaskValidationError("log_parser", f"swebench has no parser {log_parser!r}")
    eval_type = task.get("eval_type") or None
    if eval_type is not None and eval_type not in _EVAL_TYPES:
        raise TaskValidationError("eval_type", f"must be one of {', '.join(_EVAL_TYPES)}")

    default_python = python is None and image is None
    if python is None:
        python = "python" if image is not None else sys.executable
    return SweTask(
        instance_id=instance_id,
        repo=repo,
        version=str(version),
        base_commit=base_commit,
        problem_statement=problem_statement,
        test_patch=test_patch,
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        source=(repo_path or IMAGE_REPO) if image is not None else SOURCE_INSIDE,
        host_repo=None if image is not None or repo_path is None else Path(repo_path),
        image=image,
        python=python,
        test_cmd=test_cmd or f"{shlex.quote(python)} -m pytest -rA",
        log_parser=log_parser,
        eval_type=eval_type or "",
        timeout=None if timeout is None else float(timeout),
        default_python=default_python,
    )


def box_spec(task: SweTask, job_id: str, *, lease_seconds: float = 3600.0) -> SandboxSpec:
    """The box a task's repository is worked on and tested in.

    Raises `SweEnvironmentError` when `environment.repo_path` is not a git repository here.
    """
    binds = []
    if task.host_repo is not None:
        try:
            repo = allowed_repo_path(task.host_repo)
        except TaskValidationError as exc:
            raise SweEnvironmentError(f"{exc.field} {exc.message}") from None
        if not ((repo / ".git").exists() or (repo / "HEAD").is_file()):
            raise SweEnvironmentError(f"environment.repo_path {repo} is not a git repository here")
        binds.append(Bind(repo, SOURCE_INSIDE))
    env = {"PYTHONDONTWRITEBYTECODE": "1"}  # no stray .pyc files in the diff
    if os.path.isabs(task.python):
        env["PATH"] = f"{os.path.dirname(task.python)}:{DEFAULT_PATH}"
    if task.default_python:
        # The service's interpreter brings the service's pytest plugins, which are no part
        # of the repository's test environment.
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return SandboxSpec(
        job_id=job_id, root=task.image, binds=binds, env=env, lease_seconds=lease_seconds
    )


def checkout_script(task: SweTask) -> str:
    """Bash that clones the repository into the current (empty) directory at
    `base_commit`, on a branch of the source's HEAD name, with no remote left."""
    source = shlex.quote(task.source)
    return "\n".join(
        [
            "set -e",
            # The source belongs to another uid than the box's: git refuses it otherwise.
            "git config --global --add safe.directory '*'",
            "git config --global user.name agent",
            "git config --global user.email agent@rollserve.invalid",
            f"git clone -q --shared --no-checkout {source} .",
            'branch="$(git symbolic-ref --quiet --short HEAD || echo main)"',
            f'git -c advice.detachedHead=false checkout -q -B "$branch" {task.base_commit}',
            "git remote remove origin",
        ]
    )


# ----------------------------------------------------------------------------- grading


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

    @property
    def resolved(self) -> bool:
        return self.resolution == "RESOLVED_FULL"


def grade_log(task: SweTask, log: str) -> EvalReport:
    """Grade an eval log exactly as SWE-bench's `get_eval_report` does: `get_logs_eval`
    (the task's parser on the text between the markers, the infrastructure checks), then
    `get_eval_tests_report` and `get_resolution_status`."""
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
    return EvalReport(
        resolution=get_resolution_status(report),
        parsed=parsed,
        status=dict(status),
        tests={key: report[key] for key in (FAIL_TO_PASS, PASS_TO_PASS)},
        exit_code=parse_test_exit_code(log),
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


def _tail(text: str, limit: int = LOG_TAIL) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def _combined(result: ExecResult) -> str:
    return (result.stdout + result.stderr).strip()


class _Clock:
    def __init__(self, seconds: float) -> None:
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
        return box.exec(["bash", "-c", script], input=data, timeout=clock.left())

    attempts: list[dict[str, Any]] = []

    def attempt(command: str) -> bool:
        result = run(command)
        output = _tail(_combined(result), 1000)
        attempts.append({"command": command, "exit_code": result.returncode, "output": output})
        return result.returncode == 0

    for index, command in enumerate(GIT_APPLY_CMDS):
        if index:
            box.exec(["bash", "-c", "git checkout -- . ; git clean -fdq"], timeout=clock.left())
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


def evaluate(task: SweTask, patch: str, *, backend: str, state_root: Path, timeout: float) -> Grade:
    """Grade `patch` in a fresh box: clone at `base_commit`, apply the patch (reward 0 when
    it does not apply), run the eval script, grade its log with swebench (`grade_log`).

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
    # Grading boxes of graders that died: their box is gone or their lease ran out.
    reap(state_root, lambda _job: True)
    spec = box_spec(task, f"swe-grade-{secrets.token_hex(6)}", lease_seconds=timeout + 60)
    box = get_backend(backend).create(spec, state_root)
    try:
        box.start(tool_server=False, timeout=min(60.0, clock.left()))
        checkout = box.exec(["bash", "-c", checkout_script(task)], timeout=clock.left())
        if checkout.returncode != 0:
            raise SweEnvironmentError(
                f"cannot check out {task.base_commit} of {task.source}: "
                f"{_tail(_combined(checkout), 1000)}"
            )
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
        script = "\n".join(["exec 2>&1", "set -uxo pipefail", *eval_script(task)]) + "\n"
        run = box.exec(
            ["bash", "-c", "cat > /tmp/eval.sh && exec bash /tmp/eval.sh"],
            input=script.encode("utf-8"),
            timeout=clock.left(),
        )
        log = run.stdout + run.stderr
        report = grade_log(task, log)
        details.update(_report_details(report))
        details["log_tail"] = _tail(log)
        if run.timed_out:
            details["timed_out"] = True
            details["reason"] = f"the tests did not finish within {timeout:.0f}s"
            return _finish(details, 0.0, started)
        details["reason"] = _verdict(report)
        if not patch.strip():
            details["reason"] += " (the episode produced no patch: the repository is unchanged)"
        return _finish(details, 1.0 if report.resolved else 0.0, started)
    except TimeoutError:
        details.update(timed_out=True, reason=f"grading took longer than {timeout:.0f}s")
        return _finish(details, 0.0, started)
    finally:
        box.stop()


def _finish(details: dict[str, Any], reward: float, started: float) -> Grade:
    details["seconds"] = round(time.monotonic() - started, 3)
    return Grade(reward=reward, details=details)


# ----------------------------------------------------------------------------- the handler


def _budget(task: SweTask) -> float:
    return task.timeout if task.timeout is not None else get_settings().tool_timeout


class SweHandler(Handler):
    """SWE-bench tasks: the agent edits a repository in a sandbox; the instance's tests,
    run in a fresh sandbox, decide the reward (1.0 when resolved)."""

    name: ClassVar[str] = "swe"
    needs_sandbox: ClassVar[bool] = True
    grades_in_sandbox: ClassVar[bool] = False

    def validate(self, task: dict[str, Any]) -> None:
        parsed = read_task(task)
        if parsed.host_repo is not None:
            allowed_repo_path(parsed.host_repo)

    def warm_up(self) -> None:
        """Import swebench's harness (about two seconds) before the pool forks."""
        for module in ("swebench.harness.grading", "swebench.harness.run_evaluation"):
            importlib.import_module(module)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A SWE-agent-style system prompt, and the issue with where the repository is."""
        parsed = read_task(task)
        user = USER.format(
            workspace=WORKSPACE_INSIDE,
            repo=parsed.repo,
            problem_statement=parsed.problem_statement.strip(),
        )
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def tools(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return ALL_TOOLS

    def sandbox_spec(self, task: dict[str, Any], job_id: str) -> SandboxSpec:
        """The box: the task's root (its image, or the host's), the host repository bound
        read-only at /rollserve/source, the task's interpreter first on PATH."""
        return box_spec(read_task(task), job_id)

    def prepare(self, task: dict[str, Any], tools: ToolSession) -> None:
        """Clone the repository into /workspace at `base_commit`; raises
        `SweEnvironmentError` saying why when that fails."""
        parsed = read_task(task)
        script = f"(cd {WORKSPACE_INSIDE} && {{\n{checkout_script(parsed)}\n}})"
        result = tools.call("bash", command=script, timeout=_budget(parsed))
        if result.get("exit_code") != 0:
            raise SweEnvironmentError(
                f"cannot check out {parsed.base_commit} of {parsed.source} in the sandbox: "
                f"{_tail(str(result.get('output', '')), 1000)}"
            )

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        return StepResult(done=False, messages=[{"role": "user", "content": REMINDER}])

    def collect_outcome(self, task: dict[str, Any], tools: ToolSession) -> dict[str, Any]:
        """`{"patch": the diff of /workspace against base_commit (new files included,
        binary ones as git binary patches), "changed_files": [...]}`; with an `error` and
        an empty patch when git could not make it."""
        parsed = read_task(task)
        budget = _budget(parsed)
        # In a subshell, so nothing the agent left in its shell (cwd, set -e, GIT_DIR)
        # changes the diff or survives it.
        made = tools.call(
            "bash",
            command=(
                f"(cd {WORKSPACE_INSIDE} && unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE && "
                f"git add -A && git diff --cached --binary {parsed.base_commit} "
                f"> {OUTCOME_PATCH_FILE} && wc -c < {OUTCOME_PATCH_FILE} && "
                f"git diff --cached --name-only {parsed.base_commit})"
            ),
            timeout=budget,
        )
        output = str(made.get("output", ""))
        lines = output.strip().splitlines()
        if made.get("exit_code") != 0 or not lines or not lines[0].strip().isdigit():
            return {"patch": "", "changed_files": [], "error": _tail(output, 2000)}
        size = int(lines[0].strip())
        data = bytearray()
        while len(data) < size:
            chunk = tools.call(
                "bash",
                command=(
                    f"tail -c +{len(data) + 1} {OUTCOME_PATCH_FILE} | head -c {PATCH_CHUNK} "
                    "| base64 -w0"
                ),
                timeout=budget,
            )
            try:
                piece = base64.b64decode("".join(str(chunk.get("output", "")).split()))
            except binascii.Error:
                piece = b""
            if chunk.get("exit_code") != 0 or not piece:
                return {"patch": "", "changed_files": [], "error": "could not read the patch"}
            data += piece
        return {
            "patch": data.decode("utf-8", errors="replace"),
            "changed_files": [line.strip() for line in lines[1:] if line.strip()],
        }

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
    ) -> Grade:
        """Grade `outcome["patch"]` in a fresh box (see `evaluate`); the sandbox backend and
        directory are the settings', the time budget the task's `timeout` or the
        `tool_timeout` setting."""
        parsed = read_task(task)
        patch = str((outcome or {}).get("patch") or "")
        settings = get_settings()
        result = evaluate(
            parsed,
            patch,
            backend=settings.sandbox_backend,
            state_root=settings.sandbox_dir.resolve() / GRADING_DIR,
            timeout=_budget(parsed),
        )
        error = (outcome or {}).get("error")
        if error:
            result.details["outcome_error"] = error
        return result
