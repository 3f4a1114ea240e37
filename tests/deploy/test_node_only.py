"""`rollserve worker QUEUE --node-only`: a RUN or EVAL worker that serves only the jobs whose
sandbox lives on its node (the Kubernetes INIT pods run one of each beside their INIT)."""

from __future__ import annotations

import argparse

import pytest
from celery import concurrency

from broker.celery_app import worker_queues
from core.settings import Settings
from deploy.cli import build_parser, cmd_worker, worker_argv, worker_options_problem
from workers.jobpool import POOL_ENV
from workers.liveness import stages_of

NODE = "rollserve-worker-init-7d9f-abcde"


def settings() -> Settings:
    return Settings.model_validate({"node_name": NODE, "redis_url": "redis://127.0.0.1:1/0"})


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


def queues_of(argv: list[str]) -> list[str]:
    return argv[argv.index("-Q") + 1].split(",")


@pytest.fixture
def jobs_pool_left_as_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--jobs` selects its pool through the environment and Celery's pool aliases: undo both."""
    monkeypatch.delenv(POOL_ENV, raising=False)
    monkeypatch.delitem(concurrency.ALIASES, "custom", raising=False)


@pytest.mark.parametrize("stage", ["run", "eval"])
def test_node_only_worker_consumes_its_node_queue_alone(stage: str) -> None:
    argv = worker_argv(parse([stage, "--node-only", "--concurrency", "2"]), settings())
    assert queues_of(argv) == [f"{stage}.{NODE}"]
    assert argv[argv.index("-P") + 1] == "prefork"


@pytest.mark.parametrize("stage", ["run", "eval"])
def test_without_node_only_a_worker_takes_the_shared_queue_and_its_node_queue(stage: str) -> None:
    argv = worker_argv(parse([stage, "--concurrency", "2"]), settings())
    assert queues_of(argv) == [stage, f"{stage}.{NODE}"]


def test_init_worker_takes_the_shared_queue() -> None:
    assert queues_of(worker_argv(parse(["init"]), settings())) == ["init"]


@pytest.mark.usefixtures("jobs_pool_left_as_found")
def test_node_only_run_worker_may_hold_many_jobs() -> None:
    args = parse(["run", "--node-only", "--jobs", "8"])
    assert worker_options_problem(args) is None
    argv = worker_argv(args, settings())
    assert queues_of(argv) == [f"run.{NODE}"]
    assert argv[argv.index("-P") + 1] == "custom"
    assert argv[argv.index("-c") + 1] == "8"


def test_node_only_worker_beats_for_its_stage_on_its_node() -> None:
    """The sweeper restarts a pinned job when its node has no live worker for the stage: a
    node-only worker must count as one."""
    for stage in ("run", "eval"):
        assert stages_of(worker_queues(stage, NODE, node_only=True)) == [stage]


def test_node_only_init_is_refused_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["init", "--node-only"])
    assert cmd_worker(args, settings()) == 2
    err = capsys.readouterr().err
    assert "--node-only is for RUN and EVAL workers" in err
    with pytest.raises(ValueError, match="INIT has no node queue"):
        worker_queues("init", NODE, node_only=True)


def test_worker_queues_default_is_unchanged() -> None:
    assert worker_queues("init", NODE) == ["init"]
    assert worker_queues("run", NODE) == ["run", f"run.{NODE}"]
    assert worker_queues("eval", NODE) == ["eval", f"eval.{NODE}"]
