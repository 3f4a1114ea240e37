"""`swe` host repositories only from `ROLLSERVE_SWE_REPO_ROOTS`: refused by default, resolved
(symlinks, `..`) before the check, hidden directories and system trees refused, checked at
submission (a 422 naming `environment.repo_path`, nothing enqueued) and again on the worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pydantic import ValidationError

from api.app import create_app
from core.settings import Settings, get_settings
from tests.support.gateway import field_locs, serve, snapshot
from workers.handlers.base import TaskValidationError
from workers.handlers.swe.handler import SweHandler
from workers.handlers.swe.task import SweEnvironmentError, box_spec, read_task

HANDLER = SweHandler()
FIELD = "environment.repo_path"


def swe_task(repo_path: str, **environment: Any) -> dict[str, Any]:
    return {
        "data_source": "swe",
        "instance_id": "demo__repo-1",
        "repo": "demo/repo",
        "base_commit": "0123456789abcdef0123456789abcdef01234567",
        "problem_statement": "It breaks.",
        "patch": "",
        "test_patch": "",
        "FAIL_TO_PASS": ["tests/test_x.py::test_a"],
        "PASS_TO_PASS": [],
        "environment": {"repo_path": repo_path, **environment},
    }


@pytest.fixture
def set_roots(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set (or unset, with None) `ROLLSERVE_SWE_REPO_ROOTS` for this process's settings."""

    def setter(value: str | None, **others: str) -> None:
        if value is None:
            monkeypatch.delenv("ROLLSERVE_SWE_REPO_ROOTS", raising=False)
        else:
            monkeypatch.setenv("ROLLSERVE_SWE_REPO_ROOTS", value)
        for name, other in others.items():
            monkeypatch.setenv(f"ROLLSERVE_{name.upper()}", other)
        get_settings.cache_clear()

    yield setter
    get_settings.cache_clear()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """`root/` with a repository `root/repo` (and a `.git` in it), `outside/repo` beside it."""
    base = Path(os.path.realpath(tmp_path))
    for repo in (base / "root" / "repo", base / "outside" / "repo"):
        (repo / ".git").mkdir(parents=True)
    return base


def refused(task: dict[str, Any]) -> str:
    with pytest.raises(TaskValidationError) as err:
        HANDLER.validate(task)
    assert err.value.field == FIELD
    return err.value.message


def test_without_roots_a_host_repository_is_refused_saying_what_to_set(
    set_roots: Any, tree: Path
) -> None:
    set_roots(None)
    message = refused(swe_task(str(tree / "root" / "repo")))
    assert "ROLLSERVE_SWE_REPO_ROOTS" in message


def test_a_repository_under_a_root_is_accepted_and_bound_resolved(
    set_roots: Any, tree: Path
) -> None:
    set_roots(f"/nonexistent-root,{tree / 'root'}")
    task = swe_task(str(tree / "root" / "sub" / ".." / "repo"))
    HANDLER.validate(task)
    [bind] = box_spec(read_task(task), "job-1").binds
    assert bind.host == tree / "root" / "repo"
    set_roots(str(tree / "root"))
    HANDLER.validate(swe_task(str(tree / "root")))  # the root itself


def test_roots_may_be_separated_by_the_path_separator(set_roots: Any, tree: Path) -> None:
    set_roots(f"/nonexistent-root{os.pathsep}{tree / 'root'}")
    HANDLER.validate(swe_task(str(tree / "root" / "repo")))


@pytest.mark.parametrize(
    "relative",
    ["outside/repo", "root/../outside/repo", "root/repo/../../outside/repo", "rootx/repo"],
)
def test_a_repository_outside_every_root_is_refused(
    set_roots: Any, tree: Path, relative: str
) -> None:
    (tree / "rootx" / "repo").mkdir(parents=True)
    set_roots(str(tree / "root"))
    assert "ROLLSERVE_SWE_REPO_ROOTS" in refused(swe_task(str(tree / relative)))


def test_a_symlink_escaping_a_root_is_refused_without_showing_its_target(
    set_roots: Any, tree: Path
) -> None:
    (tree / "root" / "link").symlink_to(tree / "outside" / "repo")
    (tree / "root" / "inner").symlink_to(tree / "root" / "repo")
    set_roots(str(tree / "root"))
    message = refused(swe_task(str(tree / "root" / "link")))
    assert "outside" not in message
    HANDLER.validate(swe_task(str(tree / "root" / "inner")))  # a link that stays inside


def test_a_root_given_through_a_symlink_is_resolved_too(set_roots: Any, tree: Path) -> None:
    (tree / "alias").symlink_to(tree / "root")
    set_roots(str(tree / "alias"))
    HANDLER.validate(swe_task(str(tree / "root" / "repo")))
    refused(swe_task(str(tree / "outside" / "repo")))


def test_hidden_directories_below_a_root_are_refused(set_roots: Any, tree: Path) -> None:
    (tree / "root" / ".cache" / "repo").mkdir(parents=True)
    set_roots(str(tree / "root"))
    assert "hidden" in refused(swe_task(str(tree / "root" / ".cache" / "repo")))
    assert "hidden" in refused(swe_task(str(tree / "root" / "repo" / ".git")))


def test_system_trees_and_the_service_dirs_are_refused_whatever_the_roots(
    set_roots: Any, tree: Path
) -> None:
    data = tree / "root" / "data"
    (data / "repo").mkdir(parents=True)
    set_roots(f"/etc,/proc,{tree / 'root'}", data_dir=str(data))
    assert "/etc" in refused(swe_task("/etc/ssl"))
    refused(swe_task("/proc/self/cwd"))
    refused(swe_task(str(data / "repo")))
    HANDLER.validate(swe_task(str(tree / "root" / "repo")))


def test_a_path_inside_an_image_is_not_a_host_path(set_roots: Any) -> None:
    set_roots(None)
    HANDLER.validate(swe_task("/testbed", image="docker://example/swe:1"))


def test_the_worker_checks_again_before_binding(set_roots: Any, tree: Path) -> None:
    set_roots(str(tree / "root"))
    task = swe_task(str(tree / "root" / "repo"))
    HANDLER.validate(task)
    set_roots(str(tree / "outside"))  # this worker allows other roots
    with pytest.raises(SweEnvironmentError, match=FIELD):
        HANDLER.sandbox_spec(task, "job-1")


@pytest.mark.parametrize("value", ["relative/dir", "/", "/srv,repos"])
def test_roots_must_be_absolute_and_not_slash(value: str) -> None:
    with pytest.raises(ValidationError):
        Settings(swe_repo_roots=value)


def test_submission_outside_the_roots_is_422_naming_the_field_and_enqueues_nothing(
    set_roots: Any, tree: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    set_roots(str(tree / "root"))
    app = create_app(Settings(redis_url=redis_url))
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        backend = {"url": "http://127.0.0.1:9", "model": "m"}
        assert http.post("/v1/backends?verify=false", json=backend).status_code == 201
        (tree / "root" / "escape").symlink_to(tree / "outside" / "repo")
        before = snapshot(redis_client)
        for path in (tree / "outside" / "repo", tree / "root" / "escape"):
            answer = http.post("/v1/rollouts", json={"task": swe_task(str(path))})
            assert answer.status_code == 422, answer.text
            assert field_locs(answer) == ["body.task.environment.repo_path"]
            batch = {"tasks": [swe_task(str(tree / "root" / "repo")), swe_task(str(path))]}
            answer = http.post("/v1/batches", json=batch)
            assert answer.status_code == 422
            assert field_locs(answer) == ["body.tasks.1.environment.repo_path"]
        assert snapshot(redis_client) == before
        inside = http.post("/v1/rollouts", json={"task": swe_task(str(tree / "root" / "repo"))})
        assert inside.status_code == 202, inside.text
