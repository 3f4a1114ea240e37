"""`rollserve autoscale` flags: RUN workers that hold many jobs each."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from core.settings import Settings
from deploy.autoscale.command import add_arguments, policies
from deploy.autoscale.launcher import worker_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_run_jobs_sets_the_slots_of_run_workers_only(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, autoscale_concurrency=2)
    found = policies(parse("--run-jobs", "64"), settings)
    assert found["run"].concurrency == 64
    assert found["init"].concurrency == found["eval"].concurrency == 2
    assert worker_args("run", 2, 64) == ["--jobs", "64"]
    assert worker_args("init", 2, 64) == ["--concurrency", "2"]


def test_without_the_flag_the_setting_decides(tmp_path: Path) -> None:
    assert policies(parse(), Settings(data_dir=tmp_path))["run"].concurrency == 1
    settings = Settings(data_dir=tmp_path, autoscale_run_jobs=16)
    assert policies(parse(), settings)["run"].concurrency == 16
    assert policies(parse("--run-jobs", "0"), settings)["run"].concurrency == 1


def test_a_negative_count_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--run-jobs"):
        policies(parse("--run-jobs", "-1"), Settings(data_dir=tmp_path))
