"""A `swe` grade cannot be bought: what the agent's patch does to the test runner's
configuration and hooks is undone before the tests run, and a test the run never reports
fails.

Every attack leaves the bug unfixed and adds something that would make pytest report the
failing tests as passed (a `conftest.py` hooking the reports, a plugin named by an ini file,
a `sitecustomize.py`, a git hook that writes such a conftest after the reset). Each is graded
for real: a fresh bubblewrap box, a clone at `base_commit`, the patch applied as SWE-bench's
harness does, pytest run, swebench's parser. The controls (no fix: 0, the gold fix: 1, the
gold fix with an innocent change to `pyproject.toml`: 1) hold alongside.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.settings import get_settings
from sandbox.reaper import GRADING_DIR
from sandbox.statedir import remove_tree
from tests.support.procs import processes_mentioning
from tests.support.swe import BUILDER, bwrap_problem
from workers.handlers.base import Grade, TaskValidationError
from workers.handlers.swe.handler import SweHandler

HANDLER = SweHandler()
JOB = f"swe-hack-test-{uuid.uuid4().hex[:12]}"

pytestmark = pytest.mark.skipif(
    bwrap_problem() is not None, reason=str(bwrap_problem() or "bubblewrap works")
)

REPORT_HOOK = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
"""Pytest hooks that turn every test's report into a pass."""

PLUGIN = {"rs_hook.py": REPORT_HOOK}
"""The same hooks as a plugin module at the repository's root, for `-p rs_hook`."""


@pytest.fixture(scope="module")
def built() -> Iterator[dict[str, Any]]:
    """The example task `calendarx` (its fix: century years), built in a directory of its own."""
    out = Path(tempfile.mkdtemp(prefix="swe-hacks-"))
    try:
        tasks = BUILDER.build(out)
        [task] = [t for t in tasks if t["instance_id"].endswith("calendarx-1")]
        yield task
    finally:
        remove_tree(out)


@pytest.fixture
def task(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The task, with the settings grading reads: bwrap boxes in a short sandbox dir of the
    test's own, host repositories from the temporary directory. No box may be left."""
    root = Path(tempfile.mkdtemp(prefix="rs-hack-", dir="/tmp"))
    monkeypatch.setenv("ROLLSERVE_SWE_REPO_ROOTS", os.path.realpath(tempfile.gettempdir()))
    monkeypatch.setenv("ROLLSERVE_SANDBOX_BACKEND", "bwrap")
    monkeypatch.setenv("ROLLSERVE_SANDBOX_DIR", str(root))
    monkeypatch.setenv("ROLLSERVE_TOOL_TIMEOUT", "90")
    get_settings.cache_clear()
    yield dict(built)
    get_settings.cache_clear()
    left = [p for p in (root / GRADING_DIR).glob("*") if not p.name.startswith(".")]
    remove_tree(root)
    assert left == [], f"grading boxes left behind: {left}"
    assert processes_mentioning(JOB) == []


def diff_of(
    task: dict[str, Any], tmp_path: Path, files: dict[str, str], *, fix: bool = False
) -> str:
    """The patch an agent hands in: `files` written over a clone at `base_commit` (an empty
    text removes the file), with the gold fix's edits when `fix`."""
    work = tmp_path / "work"
    subprocess.run(
        ["git", "clone", "-q", task["environment"]["repo_path"], str(work)],
        check=True,
        env=BUILDER.GIT_ENV | {"PATH": "/usr/bin:/bin"},
    )
    if fix:
        [example] = [e for e in BUILDER.EXAMPLES if e.name == "calendarx"]
        BUILDER.apply_edits(work, example.fix)
    for name, text in files.items():
        path = work / name
        if not text:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    patch: str = BUILDER.staged_diff(work)
    return patch


def grade(task: dict[str, Any], patch: str) -> Grade:
    return HANDLER.grade(task, [], outcome={"patch": patch}, job_id=JOB)


def restored(result: Grade) -> list[str]:
    return [entry["path"] for entry in result.details["restored"]]


def assert_bought_nothing(result: Grade) -> None:
    assert result.reward == 0.0, result.details
    assert result.details["resolution"] == "RESOLVED_NO", result.details
    assert (
        "tests/test_century.py::test_century_years_are_common"
        in (result.details["FAIL_TO_PASS"]["failure"])
    )


# ----------------------------------------------------------------------------- controls


def test_an_unsolved_task_scores_zero(task: dict[str, Any]) -> None:
    result = grade(task, "")
    assert result.reward == 0.0
    assert result.details["restored"] == []


def test_the_gold_fix_scores_one_and_restores_nothing(task: dict[str, Any]) -> None:
    result = grade(task, task["patch"])
    assert result.reward == 1.0, result.details
    assert result.details["restored"] == []


def test_a_fix_that_also_changes_packaging_metadata_keeps_it_and_scores_one(
    task: dict[str, Any], tmp_path: Path
) -> None:
    """Only the pytest sections of pyproject.toml count: the project's version may move."""
    pyproject = Path(task["environment"]["repo_path"], "pyproject.toml").read_text()
    files = {"pyproject.toml": pyproject.replace('version = "0.1.0"', 'version = "0.1.1"')}
    result = grade(task, diff_of(task, tmp_path, files, fix=True))
    assert result.reward == 1.0, result.details
    assert result.details["restored"] == []


def test_a_fix_beside_a_hook_still_scores_one(task: dict[str, Any], tmp_path: Path) -> None:
    """The hook is taken away, the fix stays: the fix alone decides."""
    result = grade(task, diff_of(task, tmp_path, {"conftest.py": REPORT_HOOK}, fix=True))
    assert result.reward == 1.0, result.details
    assert restored(result) == ["conftest.py"]


# ----------------------------------------------------------------------------- attacks


@pytest.mark.parametrize("where", ["conftest.py", "tests/conftest.py", "calendarx/conftest.py"])
def test_a_conftest_hooking_the_reports_is_removed(
    task: dict[str, Any], tmp_path: Path, where: str
) -> None:
    result = grade(task, diff_of(task, tmp_path, {where: REPORT_HOOK}))
    assert_bought_nothing(result)
    assert restored(result) == [where]
    [entry] = result.details["restored"]
    assert entry["action"] == "removed"


@pytest.mark.parametrize(
    "name, text",
    [
        ("pytest.ini", "[pytest]\naddopts = -p rs_hook\n"),
        (".pytest.ini", "[pytest]\naddopts = -p rs_hook\n"),
        ("tests/pytest.ini", "[pytest]\naddopts = -p rs_hook\n"),
    ],
)
def test_an_ini_file_loading_a_plugin_is_removed(
    task: dict[str, Any], tmp_path: Path, name: str, text: str
) -> None:
    result = grade(task, diff_of(task, tmp_path, {name: text, **PLUGIN}))
    assert_bought_nothing(result)
    assert restored(result) == [name]


def test_a_pytest_section_added_to_pyproject_is_undone(
    task: dict[str, Any], tmp_path: Path
) -> None:
    pyproject = Path(task["environment"]["repo_path"], "pyproject.toml").read_text()
    hooked = pyproject.replace(
        'testpaths = ["tests"]', 'testpaths = ["tests"]\naddopts = "-p rs_hook"'
    )
    result = grade(task, diff_of(task, tmp_path, {"pyproject.toml": hooked, **PLUGIN}))
    assert_bought_nothing(result)
    assert result.details["restored"] == [{"path": "pyproject.toml", "action": "restored"}]


@pytest.mark.parametrize(
    "name, text",
    [
        ("tox.ini", "[pytest]\naddopts = -p rs_hook\n"),
        ("setup.cfg", "[tool:pytest]\naddopts = -p rs_hook\n"),
    ],
)
def test_a_lower_ranked_config_made_to_count_is_removed(
    task: dict[str, Any], tmp_path: Path, name: str, text: str
) -> None:
    """pyproject.toml's pytest table outranks tox.ini and setup.cfg: the agent drops it and
    adds its own. Both are undone."""
    pyproject = Path(task["environment"]["repo_path"], "pyproject.toml").read_text()
    bare = pyproject.split("[tool.pytest.ini_options]")[0]
    files = {"pyproject.toml": bare, name: text, **PLUGIN}
    result = grade(task, diff_of(task, tmp_path, files))
    assert_bought_nothing(result)
    assert sorted(restored(result)) == sorted(["pyproject.toml", name])


def test_a_sitecustomize_on_the_test_commands_path_is_removed(
    task: dict[str, Any], tmp_path: Path
) -> None:
    """A test command that puts the repository on PYTHONPATH imports its sitecustomize.py at
    interpreter start, before pytest reads any configuration."""
    task["environment"] = {
        **task["environment"],
        "test_cmd": f"env PYTHONPATH=. {sys.executable} -m pytest -rA",
    }
    site = "import os\nos.environ['PYTEST_ADDOPTS'] = '-p rs_hook'\n"
    files = {"sitecustomize.py": site, "usercustomize.py": site, **PLUGIN}
    result = grade(task, diff_of(task, tmp_path, files))
    assert_bought_nothing(result)
    assert sorted(restored(result)) == ["sitecustomize.py", "usercustomize.py"]


def test_a_path_file_is_removed(task: dict[str, Any], tmp_path: Path) -> None:
    result = grade(task, diff_of(task, tmp_path, {"rs_hook.pth": "import rs_hook\n", **PLUGIN}))
    assert_bought_nothing(result)
    assert restored(result) == ["rs_hook.pth"]


def test_a_configuration_file_the_agent_deleted_is_put_back(
    task: dict[str, Any], tmp_path: Path
) -> None:
    """The repository's own pytest configuration counts as it is at `base_commit`: a patch
    deleting it does not take it away from the tests."""
    result = grade(task, diff_of(task, tmp_path, {"pyproject.toml": ""}))
    assert result.reward == 0.0
    assert result.details["restored"] == [{"path": "pyproject.toml", "action": "restored"}]


def git_hook_patch(task: dict[str, Any], tmp_path: Path, target: str, text: str) -> str:
    """A patch `git apply` refuses (it writes into .git) and the harness's last resort,
    GNU patch, applies: an executable `target` with `text`, and a harmless edit."""
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    hook = (
        f"diff --git a/{target} b/{target}\nnew file mode 100755\nindex 0000000..1111111\n"
        f"--- /dev/null\n+++ b/{target}\n@@ -0,0 +1,{len(lines)} @@\n{body}"
    )
    return hook + diff_of(task, tmp_path, {"NOTES.md": "notes\n"})


HOOK_SCRIPT = (
    """\
#!/bin/sh
cat > conftest.py <<'PY'
"""
    + REPORT_HOOK
    + "PY\n"
)
"""A git hook writing a report-hooking conftest.py, after the test files were reset."""


def test_a_git_hook_written_past_git_apply_is_removed(task: dict[str, Any], tmp_path: Path) -> None:
    patch = git_hook_patch(task, tmp_path, ".git/hooks/post-checkout", HOOK_SCRIPT)
    result = grade(task, patch)
    assert result.details["patch_applied"] is True, result.details
    assert_bought_nothing(result)
    assert ".git/hooks/post-checkout" in restored(result)


def test_a_git_config_pointing_at_hooks_of_the_agents_is_restored(
    task: dict[str, Any], tmp_path: Path
) -> None:
    hook = git_hook_patch(task, tmp_path, "rs-hooks/post-checkout", HOOK_SCRIPT)
    config = (
        "diff --git a/.git/config b/.git/config\n--- a/.git/config\n+++ b/.git/config\n"
        "@@ -1,1 +1,3 @@\n [core]\n+\thooksPath = rs-hooks\n+\tfsmonitor = rs-hooks/post-checkout\n"
    )
    result = grade(task, config + hook)
    assert result.details["patch_applied"] is True, result.details
    assert_bought_nothing(result)
    assert ".git/config" in restored(result)


# ----------------------------------------------------------------------------- unreported tests


def test_a_named_test_the_run_never_reports_fails_even_when_only_failures_count(
    task: dict[str, Any], tmp_path: Path
) -> None:
    """With `eval_type: fail_only` swebench counts a test it did not see as a success; a
    package that cannot be imported then leaves every test unreported, not failed."""
    task["eval_type"] = "fail_only"
    broken = {"calendarx/__init__.py": "raise ImportError('broken on purpose')\n"}
    result = grade(task, diff_of(task, tmp_path, broken))
    assert result.reward == 0.0, result.details
    assert (
        "tests/test_century.py::test_century_years_are_common" in (result.details["not_reported"])
    )
    assert (
        "tests/test_century.py::test_century_years_are_common"
        in (result.details["FAIL_TO_PASS"]["failure"])
    )


def test_with_fail_only_the_gold_fix_still_scores_one(task: dict[str, Any]) -> None:
    task["eval_type"] = "fail_only"
    result = grade(task, task["patch"])
    assert result.reward == 1.0, result.details
    assert result.details["not_reported"] == []


def test_a_swe_task_may_ask_for_isolated_grading_and_never_for_less(task: dict[str, Any]) -> None:
    HANDLER.validate({**task, "grading": {"isolated": True}})
    with pytest.raises(TaskValidationError, match="grading"):
        HANDLER.validate({**task, "grading": {"isolated": False}})
