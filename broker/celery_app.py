"""The Celery app: three queues, one chain per job, settings for long I/O-bound tasks."""

from __future__ import annotations

import base64
import json

import redis
from celery import Celery, Signature, chain
from kombu import Producer, Queue

from core.settings import Settings, get_settings

QUEUES = ("init", "run", "eval")
TASK_NAMES = {stage: f"rollserve.{stage}" for stage in QUEUES}


def node_queue(stage: str, node: str) -> str:
    """The queue of `stage` tasks pinned to one node (where a job's sandbox lives)."""
    return f"{stage}.{node}"


def worker_queues(stage: str, node: str, node_only: bool = False) -> list[str]:
    """What a `stage` worker on `node` consumes: the shared queue, and for RUN and EVAL the
    node's own, which holds the jobs whose sandbox INIT started here.

    `node_only` (RUN and EVAL): the node's queue alone, for a worker that serves the boxes
    of its node and leaves sandbox-free jobs to the shared fleet.
    """
    if node_only:
        if stage == "init":
            raise ValueError("INIT has no node queue: every INIT takes the shared queue `init`")
        return [node_queue(stage, node)]
    return [stage] if stage == "init" else [stage, node_queue(stage, node)]


def create_celery(settings: Settings, broker_url: str) -> Celery:
    """A Celery app on `broker_url` configured from `settings`.

    Late acknowledgement with requeue on worker loss and a prefetch of one: a job whose worker
    dies is redelivered, and a busy process never sits on a second job. The Redis visibility
    timeout stays above every hard time limit so a long stage is not redelivered while it runs.
    """
    app = Celery("rollserve", broker=broker_url, backend=broker_url, include=["workers.tasks"])
    app.conf.update(
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue="run",
        task_routes={TASK_NAMES[stage]: {"queue": stage} for stage in QUEUES},
        task_annotations={
            TASK_NAMES[stage]: {
                "soft_time_limit": getattr(settings, f"{stage}_soft_time_limit"),
                "time_limit": getattr(settings, f"{stage}_time_limit"),
            }
            for stage in QUEUES
        },
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": settings.effective_visibility_timeout,
            # Sweep for tasks of dead workers every interval (kombu otherwise waits 10 sweeps).
            "unacked_restore_interval": settings.redelivery_check_interval,
            "unacked_restore_throttle": 1,
        },
        result_backend_transport_options={
            "visibility_timeout": settings.effective_visibility_timeout
        },
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        # A worker that cannot reach the broker for good exits (non-zero) for its supervisor
        # (systemd, `rollserve up`) to restart, rather than retrying for the better part of
        # an hour.
        broker_connection_max_retries=settings.broker_connection_max_retries,
        # A stage running when the broker connection drops goes on (its job-store commands
        # wait for Redis) and is acknowledged over the new connection; one whose ack is lost
        # is redelivered after the visibility timeout and finds its stage already done.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        result_expires=settings.result_expires,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # Stage outcomes live in the job store; Celery's own result records would only add a
        # Redis round trip per stage.
        task_ignore_result=True,
        task_track_started=False,
        task_send_sent_event=True,
        worker_send_task_events=True,
        worker_hijack_root_logger=False,
        worker_max_tasks_per_child=1000,
    )
    return app


_app: Celery | None = None


def get_celery() -> Celery:
    """The process's Celery app, on `ROLLSERVE_REDIS_URL`."""
    global _app
    if _app is None:
        settings = get_settings()
        if not settings.redis_url:
            raise RuntimeError(
                "ROLLSERVE_REDIS_URL is not set: start the stack with `rollserve up`, "
                "or point ROLLSERVE_REDIS_URL at a Redis server"
            )
        _app = create_celery(settings, settings.redis_url)
    return _app


def job_chain(app: Celery, job_id: str, task_ids: dict[str, str]) -> chain:
    """The job's pipeline, init → run → eval, with the task ids recorded in its job record."""
    return chain(*_stage_signatures(app, job_id, task_ids))


def _stage_signatures(app: Celery, job_id: str, task_ids: dict[str, str]) -> list[Signature]:
    return [
        app.signature(TASK_NAMES[stage], args=(job_id,), immutable=True).set(
            task_id=task_ids[stage]
        )
        for stage in QUEUES
    ]


def send_job(app: Celery, job_id: str, task_ids: dict[str, str], producer: Producer) -> None:
    """Publish the job's INIT task with the rest of its chain in the message, on `producer`.

    This is the message `job_chain(...).apply_async()` sends, but it uses only the producer
    given: Celery's chain drops a `producer=` argument and takes a second producer (and
    connection) from the same pools, so callers holding one could exhaust them and wait on
    each other for good.
    """
    first, *rest = _stage_signatures(app, job_id, task_ids)
    app.send_task(
        first.task,
        args=first.args,
        task_id=task_ids["init"],
        producer=producer,
        # The worker pops the next link from the end of the list.
        chain=[dict(link) for link in reversed(rest)],
    )


def send_stage(
    app: Celery,
    job_id: str,
    task_ids: dict[str, str],
    stage: str,
    attempt: int,
    producer: Producer,
    queues: dict[str, str] | None = None,
) -> None:
    """Publish the job's `stage` task again, with the stages after it as the rest of its
    chain, each carrying `attempt` (a worker drops a message of an earlier attempt).

    `queues` names the queue of a stage that does not go to its shared queue (a stage
    pinned to the node of the job's sandbox).
    """
    queues = queues or {}
    first, *rest = [
        app.signature(TASK_NAMES[name], args=(job_id, attempt), immutable=True).set(
            task_id=task_ids[name], queue=queues.get(name, name)
        )
        for name in QUEUES[QUEUES.index(stage) :]
    ]
    app.send_task(
        first.task,
        args=first.args,
        task_id=task_ids[stage],
        queue=queues.get(stage, stage),
        producer=producer,
        chain=[dict(link) for link in reversed(rest)],
    )


UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"
"""Where kombu's Redis transport keeps the messages workers fetched and have not acknowledged
(by delivery tag) and when each was fetched."""


def unacked_stages(client: redis.Redis, fetched_before: float) -> list[tuple[str, str, int]]:
    """The stage messages workers fetched from Redis before `fetched_before` (Unix time) and
    have not acknowledged, as (job id, stage, attempt): running, waiting in a worker, or held
    by a worker that died (Redis gives those out again only after the visibility timeout)."""
    tags = client.zrangebyscore(UNACKED_INDEX, "-inf", fetched_before)
    if not tags:
        return []
    found: list[tuple[str, str, int]] = []
    for raw in client.hmget(UNACKED, tags):
        if raw is None:
            continue  # acknowledged meanwhile
        try:
            message = json.loads(raw)[0]
            task = message["headers"]["task"]
            args = json.loads(base64.b64decode(message["body"]))[0]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        stage = task.rpartition(".")[2]
        if task != TASK_NAMES.get(stage) or not args or not isinstance(args[0], str):
            continue
        attempt = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        found.append((args[0], stage, attempt))
    return found


PRIORITY_SEP = "\x06\x16"
"""What kombu's Redis transport puts between a queue's name and a message priority."""
PRIORITY_STEPS = (3, 6, 9)


def message_id(raw: bytes | str) -> str | None:
    """The task id of a message as kombu's Redis transport stores it (in a queue list, or in
    `unacked` as `[message, exchange, routing key]`), or None when it is not one."""
    try:
        message = json.loads(raw)
        if isinstance(message, list):
            message = message[0]
        task_id = message["headers"]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return task_id if isinstance(task_id, str) else None


def find_messages(
    client: redis.Redis, queues: list[str], wanted: set[str], chunk: int = 500
) -> set[str]:
    """Which of the task ids `wanted` have a message in Redis: waiting in one of `queues`
    (read from the oldest end, stopping once every one is found) or fetched by a worker and
    not yet acknowledged."""
    found: set[str] = set()
    names = [
        q for name in queues for q in (name, *(f"{name}{PRIORITY_SEP}{p}" for p in PRIORITY_STEPS))
    ]
    for name in names:
        start = 0
        while found != wanted:
            raws = client.lrange(name, -start - chunk, -start - 1)
            found.update(i for i in map(message_id, raws) if i in wanted)
            if len(raws) < chunk:
                break
            start += chunk
    if found != wanted:
        for _, raw in client.hscan_iter(UNACKED, count=chunk):
            task_id = message_id(raw)
            if task_id in wanted:
                found.add(task_id)
    return found
