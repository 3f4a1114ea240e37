"""A `swe` box holds nothing of the task's future: the repository it clones is made for the job
with `base_commit`'s history only, though the host repository goes on past it (a later commit
on its branch, the gold fix on another branch, tagged, stashed, noted, under a remote ref,
all packed), and the gold patch still grades 1.0 from it."""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.settings import get_settings
from sandbox.keeper import launch, release
from sandbox.reaper import JOB_DATA_DIR, reap
from sandbox.statedir import remove_tree
from sandbox.toolclient import ToolClient
from tests.support.sandbox import find_job_processes, leftovers
from tests.support.swe import BUILDER, bwrap_problem
from workers.handlers.swe.handler import SweHandler
from workers.handlers.swe.task import job_source, read_task

HANDLER = SweHandler()
MARKER = "GOLD-FIX-NOTE-5e1c0b"
"""Text only the gold fix's commit holds."""

needs_bwrap = pytest.mark.skipif(
    bwrap_problem() is not None, reason=str(bwrap_problem() or "bubblewrap works")
)


def git(repo: Path, *args: str, input: str | None = None) -> str:
    env = {**os.environ, **BUILDER.GIT_ENV}
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        env=env, input=input, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


class Future:
    """The example task `calendarx` and what its repository holds past `base_commit`."""

    def __init__(self, task: dict[str, Any], repo: Path) -> None:
        self.task = task
        self.repo = repo
        base = task["base_commit"]
        # The gold fix and its tests stashed, then committed on a branch of their own, with
        # a note and tags.
        # Applied to the files, then staged: `apply --index` would also compare the index's
        # stat data, which the builder's chmod (make_readable) can leave stale.
        for patch in (task["patch"], task["test_patch"]):
            git(repo, "apply", "-", input=patch)
        git(repo, "add", "-A")
        git(repo, "stash", "store", "-m", "gold", git(repo, "stash", "create"))
        git(repo, "checkout", "-q", "-b", "fix")
        (repo / "FIX_NOTES.md").write_text(f"{MARKER}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"Fix century years ({MARKER})")
        self.fix = git(repo, "rev-parse", "HEAD")
        self.fix_blob = git(repo, "rev-parse", "HEAD:calendarx/leap.py")
        self.marker_blob = git(repo, "rev-parse", "HEAD:FIX_NOTES.md")
        git(repo, "tag", "-a", "v0.1.1", "-m", f"release with {MARKER}")
        git(repo, "tag", "gold")
        git(repo, "notes", "add", "-m", f"fixed in {self.fix}", base)
        git(repo, "update-ref", "refs/remotes/upstream/main", self.fix)
        # History goes on past base_commit on the branch the repository's HEAD names.
        git(repo, "checkout", "-q", "main")
        (repo / "LATER.md").write_text("later work\n")
        git(repo, "add", "LATER.md")
        git(repo, "commit", "-q", "-m", "Later work")
        self.later = git(repo, "rev-parse", "HEAD")
        git(repo, "gc", "-q")  # every object, the future's too, in one pack
        BUILDER.make_readable(repo)
        self.past = set(git(repo, "rev-list", "--objects", base).split("\n"))
        self.past = {line.split()[0] for line in self.past if line}


@pytest.fixture
def job_sandbox_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="rs-fut-", dir="/tmp"))
    monkeypatch.setenv("ROLLSERVE_SWE_REPO_ROOTS", os.path.realpath(tempfile.gettempdir()))
    monkeypatch.setenv("ROLLSERVE_SANDBOX_BACKEND", "bwrap")
    monkeypatch.setenv("ROLLSERVE_SANDBOX_DIR", str(root))
    monkeypatch.setenv("ROLLSERVE_TOOL_TIMEOUT", "60")
    get_settings.cache_clear()
    yield root
    get_settings.cache_clear()
    remove_tree(root)


@pytest.fixture
def future() -> Iterator[Future]:
    out = Path(tempfile.mkdtemp(prefix="swe-future-"))
    try:
        tasks = BUILDER.build(out)
        [task] = [t for t in tasks if t["instance_id"].endswith("calendarx-1")]
        yield Future(task, Path(task["environment"]["repo_path"]))
    finally:
        remove_tree(out)


def test_the_host_repository_does_hold_the_future(future: Future) -> None:
    """The premise: everything below would be found in the host repository itself."""
    assert future.fix in git(future.repo, "rev-list", "--all")
    assert MARKER in git(future.repo, "log", "--all", "--format=%s")
    assert future.fix_blob not in future.past and future.marker_blob not in future.past


def test_the_jobs_repository_holds_base_commits_history_and_nothing_else(
    future: Future, job_sandbox_dir: Path
) -> None:
    task = read_task(future.task)
    made = job_source(task, "job-future-1", job_sandbox_dir).host_repo
    assert made is not None and made.is_relative_to(job_sandbox_dir / JOB_DATA_DIR)
    assert git(made, "rev-list", "--all") == future.task["base_commit"]
    assert git(made, "for-each-ref", "--format=%(refname)") == "refs/heads/main"
    assert git(made, "symbolic-ref", "HEAD") == "refs/heads/main"
    objects = git(made, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)")
    assert set(objects.split()) <= future.past
    for sha in (future.fix, future.later, future.fix_blob, future.marker_blob):
        assert subprocess.run(["git", "-C", str(made), "cat-file", "-e", sha]).returncode != 0
    assert not git(made, "remote")
    assert not (made / "logs").exists() and not (made / "FETCH_HEAD").exists()
    assert not (made / "packed-refs").exists() or "tags" not in (made / "packed-refs").read_text()
    # Made once per job: EVAL on the same host takes the same one.
    assert job_source(task, "job-future-1", job_sandbox_dir).host_repo == made
    # Gone once the job is over.
    reap(job_sandbox_dir, lambda job_id: job_id != "job-future-1")
    assert list((job_sandbox_dir / JOB_DATA_DIR).iterdir()) == []


def in_box(tools: ToolClient, command: str) -> tuple[int, str]:
    result = tools.call("bash", command=command)
    return int(result.get("exit_code", -1)), str(result.get("output", ""))


@needs_bwrap
def test_inside_the_box_git_cannot_reach_the_fix_and_the_gold_patch_still_grades(
    future: Future, job_sandbox_dir: Path
) -> None:
    task = future.task
    job_id = f"swe-future-{uuid.uuid4().hex[:8]}"
    spec = HANDLER.sandbox_spec(task, job_id)
    assert [b.host for b in spec.binds] != [future.repo]
    kept = launch(spec, "bwrap", job_sandbox_dir)
    try:
        with ToolClient(kept.socket_path, timeout=60) as tools:
            HANDLER.prepare(task, tools)
            for where in ("/workspace", "/rollserve/source"):
                code, out = in_box(tools, f"git -C {where} log --all --format=%H%n%s%n%N")
                assert code == 0 and future.fix not in out and MARKER not in out, out
                code, out = in_box(tools, f"git -C {where} rev-list --all")
                assert code == 0 and out.split() == [task["base_commit"]], out
                for sha in (future.fix, future.later, future.fix_blob, future.marker_blob):
                    code, out = in_box(tools, f"git -C {where} cat-file -p {sha}")
                    assert code != 0, out
                code, out = in_box(
                    tools,
                    f"git -C {where} cat-file --batch-all-objects --batch-check='%(objectname)'",
                )
                assert code == 0 and set(out.split()) <= future.past, out
                code, out = in_box(tools, f"git -C {where} log --all --oneline -S 'year % 400'")
                assert code == 0 and not out.strip(), out
            code, out = in_box(
                tools, "git -C /workspace for-each-ref; git -C /workspace stash list; "
                "git -C /workspace reflog --all; git -C /workspace notes list; ls /rollserve/source"
            )  # fmt: skip
            assert future.fix not in out and "tags" not in out and "stash" not in out, out
            code, out = in_box(tools, f"grep -rIl {MARKER} /workspace /rollserve/source")
            assert code == 1 and not out.strip(), out
            in_box(tools, f"git apply <<'EOF'\n{task['patch']}EOF")
            outcome = HANDLER.collect_outcome(task, tools)
    finally:
        release(kept)
    assert outcome["changed_files"] == ["calendarx/leap.py"]
    result = HANDLER.grade(task, [], outcome=outcome, job_id=job_id)
    assert result.reward == 1.0, result.details
    assert find_job_processes(job_id) == []
    reap(job_sandbox_dir, lambda other: other != job_id)
    assert leftovers(job_sandbox_dir) == []  # nor grading box, nor keeper log, nor job data
