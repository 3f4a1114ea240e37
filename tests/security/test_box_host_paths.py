"""The host as a box: `environment.image` of a `swe` task names the box's root, so a path
the policy does not bound would give the box the host itself.

An image path is accepted only under `ROLLSERVE_SWE_IMAGE_ROOTS` (refused at submission
naming `environment.image`, and again on the worker), never `/`, the host's homes, /root,
/run or the service's directories. And whatever root a box gets, even the host's `/` whole,
the host's homes, /root, /run, the service's data directory and the sandbox directory (other
boxes' sockets and files) are covered where it would see them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.settings import Settings
from sandbox.bwrap import BubblewrapSandbox
from sandbox.startup import service_paths
from tests.support.sandbox import SandboxFactory
from workers.handlers.base import TaskValidationError
from workers.handlers.swe.handler import SweHandler
from workers.handlers.swe.task import SweEnvironmentError, checked_on_worker, read_task

TASK: dict[str, Any] = {
    "data_source": "swe",
    "instance_id": "x__y-1",
    "repo": "x/y",
    "base_commit": "a" * 40,
    "problem_statement": "Fix it.",
    "test_patch": "",
    "FAIL_TO_PASS": ["tests/test_x.py::test_x"],
    "PASS_TO_PASS": [],
}


def with_image(image: str) -> dict[str, Any]:
    return {**TASK, "environment": {"image": image}}


@pytest.fixture
def images(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "images"
    (root / "python3.11" / "usr").mkdir(parents=True)
    yield root


def handler(**settings: Any) -> SweHandler:
    return SweHandler(settings=Settings(**settings))


@pytest.mark.parametrize("image", ["/", "/srv/images/x", "/root", "/home/user/image"])
def test_without_image_roots_no_image_path_is_accepted(image: str) -> None:
    with pytest.raises(TaskValidationError) as caught:
        handler().validate(with_image(image))
    assert caught.value.field == "environment.image"
    assert "ROLLSERVE_SWE_IMAGE_ROOTS" in caught.value.message


def test_an_image_under_a_root_is_accepted_and_a_uri_needs_none(images: Path) -> None:
    handler(swe_image_roots=str(images)).validate(with_image(str(images / "python3.11")))
    handler().validate(with_image("docker://swebench/sweb.eval.x86_64.x_1776_y-1:latest"))


@pytest.mark.parametrize("where", ["/", "..", "../.."])
def test_the_host_root_or_a_path_out_of_the_roots_is_refused(images: Path, where: str) -> None:
    image = where if where == "/" else str(images / "python3.11" / where / "..")
    with pytest.raises(TaskValidationError) as caught:
        handler(swe_image_roots=str(images)).validate(with_image(image))
    assert caught.value.field == "environment.image"


def test_a_symlink_out_of_the_roots_is_refused(images: Path) -> None:
    (images / "escape").symlink_to("/")
    with pytest.raises(TaskValidationError, match="not under a directory"):
        handler(swe_image_roots=str(images)).validate(with_image(str(images / "escape")))


def test_the_services_directories_are_refused_whatever_the_roots(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sandboxes").mkdir(parents=True)
    settings = {
        "swe_image_roots": str(tmp_path),
        "data_dir": data,
        "sandbox_dir": data / "sandboxes",
    }
    for image in (data, data / "sandboxes", tmp_path):
        with pytest.raises(TaskValidationError, match="which no image may"):
            handler(**settings).validate(with_image(str(image)))


def test_the_worker_checks_the_image_again(images: Path) -> None:
    parsed = read_task(with_image(str(images / "python3.11")))
    assert checked_on_worker(parsed, Settings(swe_image_roots=str(images))).image
    with pytest.raises(SweEnvironmentError, match=r"environment\.image"):
        checked_on_worker(parsed, Settings())


def test_a_box_on_the_hosts_whole_root_sees_none_of_its_private_paths(
    bwrap_sandbox: SandboxFactory,
    state_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    visible_host_dir: Path,
) -> None:
    data = visible_host_dir / "data"
    data.mkdir()
    (data / "secret").write_text("service state")
    monkeypatch.setenv("ROLLSERVE_DATA_DIR", str(data))
    other = bwrap_sandbox()  # another box: its state dir, with its socket directory
    box = bwrap_sandbox(root="/")
    assert isinstance(box, BubblewrapSandbox)
    private = [p for p in ("/root", "/home", "/run") if os.path.isdir(p)]
    private += [str(state_root), str(data)]
    script = 'for d in "$@"; do ls -A "$d" | sed "s|^|$d/|"; done'
    listing = box.exec(["sh", "-c", script, "sh", *private])
    assert listing.returncode == 0, listing
    # Only the way to the service's own Python (bound read-only) may show, nothing else.
    seen = listing.stdout.split()
    assert not [p for p in seen if not any(s.startswith(p) for s in map(str, service_paths()))]
    assert box.exec(["test", "-e", str(other.state_dir)]).returncode != 0
    # Public parts of the root are there: it is the host's root.
    assert box.exec(["test", "-x", "/usr/bin/env"]).returncode == 0
