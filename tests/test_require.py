"""`ROLLSERVE_TEST_REQUIRE` turns the skips of required components into failures; without it
they stay skips that say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.require import REQUIRE_ENV, required

REPO = Path(__file__).resolve().parents[1]

SAMPLE = """
import pytest

@pytest.mark.vllm
def test_marked():
    pytest.skip("vLLM is not installed (make vllm)")

def test_box():
    pytest.skip("bubblewrap cannot make boxes here: no user namespaces")

def test_other():
    pytest.skip("SkyRL is not installed here")

def test_runs():
    assert True
"""


def run_sample(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    sample = tmp_path / "test_sample.py"
    sample.write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: needs vLLM\n")
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    if require is not None:
        env[REQUIRE_ENV] = require
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.support.require",
         "-p", "no:cacheprovider", str(sample)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_without_the_variable_skips_stay_skips_and_say_why(tmp_path: Path) -> None:
    done = run_sample(tmp_path, None)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 3 skipped" in done.stdout
    assert "bubblewrap cannot make boxes here" in done.stdout


def test_required_components_fail_instead_of_skipping(tmp_path: Path) -> None:
    done = run_sample(tmp_path, "vllm,bwrap")
    assert done.returncode == 1, done.stdout
    assert "2 failed, 1 passed, 1 skipped" in done.stdout, done.stdout
    assert f"{REQUIRE_ENV} requires vllm here" in done.stdout
    assert f"{REQUIRE_ENV} requires bwrap here" in done.stdout


def test_a_component_not_required_still_skips(tmp_path: Path) -> None:
    done = run_sample(tmp_path, "slurm")
    assert done.returncode == 0 and "1 passed, 3 skipped" in done.stdout, done.stdout


def test_an_unknown_component_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match="the components are"):
        required("bwrap,gpu")
    assert required(" vllm , netns ") == {"vllm", "netns"}
