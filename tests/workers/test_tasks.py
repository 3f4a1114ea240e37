"""Worker start-up: only workers that grade load the graders."""

from __future__ import annotations

from types import SimpleNamespace

from broker.celery_app import create_celery, worker_queues
from core.settings import Settings
from workers.tasks import consumes_eval


def worker_on(queues: list[str]) -> SimpleNamespace:
    app = create_celery(Settings(), "redis://127.0.0.1:1/0")
    app.amqp.queues.select(queues)
    return SimpleNamespace(app=app)


def test_eval_workers_warm_the_graders() -> None:
    assert consumes_eval(worker_on(worker_queues("eval", "node-a")))


def test_init_and_run_workers_skip_the_graders() -> None:
    assert not consumes_eval(worker_on(worker_queues("init", "node-a")))
    assert not consumes_eval(worker_on(worker_queues("run", "node-a")))


def test_a_worker_that_cannot_tell_warms_them() -> None:
    assert consumes_eval(SimpleNamespace())
