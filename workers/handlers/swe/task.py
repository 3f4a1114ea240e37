"""`swe` tasks: the SWE-bench instance record, checked, and the box its repository is worked in.

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

The box never sees a host repository itself: the worker makes a repository for the job
(`job_source`) holding `base_commit`'s history and nothing else (no other branch, tag,
reflog, stash, remote, note or object of a later commit), binds that one read-only at
`/rollserve/source`, and the box clones it. The reaper removes it once the job is over.

Host repositories come only from the directories the operator names in
`ROLLSERVE_SWE_REPO_ROOTS` (none by default: such tasks are refused until it is set). A
`repo_path` is resolved (symlinks, `..`) before it is checked (`allowed_repo_path`), at
submission and again on the worker, which binds the resolved path; below its root no
component may be hidden (start with `.`), and nothing is taken from `REFUSED_TREES` or the
service's data and sandbox directories, whatever the roots say.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.schemas import json_problem
from core.settings import Settings
from sandbox.base import DEFAULT_PATH, Bind, SandboxSpec
from sandbox.reaper import JOB_FILE, job_data_dir
from sandbox.statedir import remove_tree
from workers.handlers.base import TaskValidationError, required_text

SOURCE_INSIDE = "/rollserve/source"
"""Where a host repository (`environment.repo_path`) is bound in the box, read-only."""
IMAGE_REPO = "/testbed"
"""Where the repository is in an image when `environment.repo_path` does not say."""

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


def allowed_repo_path(repo_path: Path | str, settings: Settings) -> Path:
    """The real path of a host repository (symlinks and `..` resolved) when the policy of
    `settings` allows it (see the module docstring); a `TaskValidationError` naming
    `environment.repo_path` otherwise. The message never shows where a symlink leads."""
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


IMAGE_REFUSED_TREES = (*REFUSED_TREES, "/root", "/home")
"""Host trees no image is taken from, whatever `ROLLSERVE_SWE_IMAGE_ROOTS` says."""


def allowed_image(image: str, settings: Settings) -> str:
    """`image` when the policy of `settings` allows it: a URI (`docker://...`) as it is, a
    path resolved (symlinks, `..`) and under a root of `ROLLSERVE_SWE_IMAGE_ROOTS`, outside
    `IMAGE_REFUSED_TREES` and the service's data and sandbox directories. A
    `TaskValidationError` naming `environment.image` otherwise."""
    if not os.path.isabs(image):
        return image
    name = "environment.image"
    roots = settings.swe_image_root_list
    if not roots:
        raise TaskValidationError(
            name,
            "names a path on the host, and none is allowed: set ROLLSERVE_SWE_IMAGE_ROOTS (on "
            "the gateway and the workers) to the directories images may come from",
        )
    real = Path(os.path.realpath(image))
    if not any(real.is_relative_to(root) for root in roots) or real == Path("/"):
        raise TaskValidationError(
            name, "is not under a directory ROLLSERVE_SWE_IMAGE_ROOTS allows (once resolved)"
        )
    service_dirs = (settings.data_dir, settings.sandbox_dir)
    for tree in (*IMAGE_REFUSED_TREES, *(os.path.realpath(d) for d in service_dirs)):
        tree_real = Path(os.path.realpath(tree))
        if real.is_relative_to(tree_real) or tree_real.is_relative_to(real):
            raise TaskValidationError(name, f"holds or is in {tree}, which no image may")
    return str(real)


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


def checked_on_worker(task: SweTask, settings: Settings) -> SweTask:
    """`task` with its host repository checked again against this worker's policy
    (`allowed_repo_path`) and resolved, and its image path checked too (`allowed_image`),
    ready for `box_spec`; raises `SweEnvironmentError` saying why when the policy refuses it."""
    if task.image is not None:
        try:
            task = dataclasses.replace(task, image=allowed_image(task.image, settings))
        except TaskValidationError as exc:
            raise SweEnvironmentError(f"{exc.field} {exc.message}") from None
    if task.host_repo is None:
        return task
    try:
        repo = allowed_repo_path(task.host_repo, settings)
    except TaskValidationError as exc:
        raise SweEnvironmentError(f"{exc.field} {exc.message}") from None
    return dataclasses.replace(task, host_repo=repo)


SOURCE_REPO = "repo"
"""The job's repository in its job data dir (`sandbox.reaper.job_data_dir`)."""


def _git(args: list[str], config: Path, timeout: float) -> str:
    """Run git with `config` as its only configuration (none of the host's or the user's),
    never prompting; its stdout, or a `SweEnvironmentError` with its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=str(config), GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0")
    try:
        done = subprocess.run(
            ["git", *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise SweEnvironmentError(f"git {args[0]} took longer than {timeout:.0f}s") from None
    if done.returncode != 0:
        raise SweEnvironmentError(f"git {' '.join(args[:3])}: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()


def _readable(tree: Path) -> None:
    """Make `tree` readable to every uid (boxes run under uids of their own)."""
    for top, _dirs, files in os.walk(tree):
        os.chmod(top, 0o755)
        for name in files:
            path = os.path.join(top, name)
            os.chmod(path, os.stat(path).st_mode & 0o777 | 0o444)


def _data_name(job_id: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", job_id):
        return job_id
    import hashlib

    return hashlib.sha256(job_id.encode()).hexdigest()[:32]


def job_source(task: SweTask, job_id: str, sandbox_dir: Path, *, timeout: float = 300.0) -> SweTask:
    """`task` with its host repository replaced by one made for `job_id` under
    `sandbox_dir` (`<sandbox_dir>/.jobs/<job>/repo`, a bare repository): `base_commit`'s
    history on one branch named as the host repository's HEAD, and nothing else — no other
    ref, no reflog, no remote, no object a later commit brought. Made once per job and
    host (INIT and EVAL share it); the reaper removes it once the job is over.

    Raises `SweEnvironmentError` when the host repository is not a git repository or does
    not hold `base_commit`. A task without a host repository is returned as it is.
    """
    if task.host_repo is None:
        return task
    repo = Path(os.path.realpath(task.host_repo))
    if not ((repo / ".git").exists() or (repo / "HEAD").is_file()):
        raise SweEnvironmentError(f"environment.repo_path {repo} is not a git repository here")
    home = job_data_dir(sandbox_dir, _data_name(job_id))
    made = home / SOURCE_REPO
    if (made / "HEAD").is_file():
        return dataclasses.replace(task, host_repo=made)
    home.parent.mkdir(parents=True, exist_ok=True)
    build = home.parent / f".build-{secrets.token_hex(6)}"
    build.mkdir(mode=0o700)
    try:
        config = build / "gitconfig"
        # The host repository belongs to another uid than the worker's, maybe; commits are
        # asked for by id (upload-pack refuses unadvertised ones otherwise).
        config.write_text("[safe]\n\tdirectory = *\n[uploadpack]\n\tallowAnySHA1InWant = true\n")
        try:
            commit = _git(
                ["-C", str(repo), "rev-parse", "--verify", "--quiet",
                 f"{task.base_commit}^{{commit}}"],
                config,
                timeout,
            )  # fmt: skip
        except SweEnvironmentError:
            raise SweEnvironmentError("base_commit is not a commit there") from None
        try:
            branch = _git(
                ["-C", str(repo), "symbolic-ref", "--quiet", "--short", "HEAD"], config, timeout
            )
        except SweEnvironmentError:
            branch = ""
        branch = branch or "main"
        target = build / SOURCE_REPO
        _git(["init", "--quiet", "--bare", "--template=", str(target)], config, timeout)
        _git(
            ["-C", str(target), "fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
             str(repo), f"+{commit}:refs/heads/{branch}"],
            config,
            timeout,
        )  # fmt: skip
        _git(["-C", str(target), "symbolic-ref", "HEAD", f"refs/heads/{branch}"], config, timeout)
        config.unlink()
        (build / JOB_FILE).write_text(job_id)
        _readable(build)
        try:
            os.rename(build, home)
        except OSError:  # made meanwhile by another stage of the job
            if not (made / "HEAD").is_file():
                raise
    except SweEnvironmentError as exc:
        raise SweEnvironmentError(
            f"cannot take {task.base_commit} from environment.repo_path {repo}: {exc}"
        ) from None
    finally:
        remove_tree(build)
    return dataclasses.replace(task, host_repo=made)


def box_spec(task: SweTask, job_id: str, *, lease_seconds: float = 3600.0) -> SandboxSpec:
    """The box a task's repository is worked on and tested in: a host repository is bound by
    its real path, once the policy allowed it (`checked_on_worker`).

    Raises `SweEnvironmentError` when `environment.repo_path` is not a git repository here.
    """
    binds = []
    if task.host_repo is not None:
        repo = Path(os.path.realpath(task.host_repo))
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
