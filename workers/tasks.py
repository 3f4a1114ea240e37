"""The Celery tasks: thin adapters from a queue message to a stage function."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from celery import Task, shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_init, worker_ready

from broker.celery_app import node_queue
from broker.jobstore import JobNotFound
from core.schemas import JobStatus, StageError
from routing.health import sweep, take_turn
from routing.restarts import engine_started
from sandbox.base import SandboxSecurityError
from sandbox.reaper import reap
from workers import boxreport, liveness, stages
from workers.handlers.registry import get_handler, known_handlers
from workers.lifecycle import connect_worker_hooks, tracked
from workers.process_state import Runtime, get_runtime
from workers.sweeper import sweep_forever

log = logging.getLogger(__name__)

connect_worker_hooks()


def execute_stage(task: Task, stage: str, job_id: str, fn: Callable[[Runtime, str], bool]) -> None:
    """Run one stage; on error or time-out end the job with its partial trajectory.

    When the job does not go on (finished, failed, cancelled) the rest of the chain is dropped,
    so no later stage runs for it.
    """
    rt = get_runtime()
    try:
        proceed = fn(rt, job_id)
    except JobNotFound:
        log.warning(
            "job %s is not in the store (expired or deleted); dropping its %s", job_id, stage
        )
        proceed = False
    except stages.TimeBudgetSpent as exc:
        rt.end_job(
            job_id, JobStatus.timed_out, StageError(stage=stage, type="timeout", message=str(exc))
        )
        proceed = False
    except SoftTimeLimitExceeded:
        limit = getattr(rt.settings, f"{stage}_soft_time_limit")
        rt.end_job(
            job_id,
            JobStatus.timed_out,
            StageError(
                stage=stage, type="timeout", message=f"{stage} ran past its {limit:g}s limit"
            ),
        )
        proceed = False
    except SandboxSecurityError as exc:
        # Never a grade: the job fails, as a security error the trainer and operator can tell
        # from any other failure.
        log.error("job %s: security check failed in %s: %s", job_id, stage, exc)
        rt.end_job(
            job_id, JobStatus.failed, StageError(stage=stage, type="security", message=str(exc))
        )
        proceed = False
    except Exception as exc:
        log.exception("job %s failed in %s", job_id, stage)
        rt.end_job(
            job_id,
            JobStatus.failed,
            StageError(stage=stage, type=type(exc).__name__, message=str(exc) or repr(exc)),
        )
        proceed = False
    if not proceed:
        task.request.chain = None
    elif stage == "init":
        pin_to_sandbox_node(task, rt, job_id)


def pin_to_sandbox_node(task: Task, rt: Runtime, job_id: str) -> None:
    """Send the job's RUN (and EVAL, when it grades in the sandbox) to the node whose INIT
    started its sandbox: the box, its socket and its keeper live only there."""
    record = rt.store.get(job_id)
    if record.sandbox is None or not task.request.chain:
        return
    node = str(record.sandbox["host"])
    pinned = ["run", "eval"] if get_handler(record.data_source).grades_in_sandbox else ["run"]
    # The rest of the chain travels in the message, next task last; its options are applied
    # when this task returns.
    for link in task.request.chain:
        stage = str(link.get("task", "")).rsplit(".", 1)[-1]
        if stage in pinned:
            link.setdefault("options", {})["queue"] = node_queue(stage, node)


def consumes_eval(worker: Any) -> bool:
    """Whether a starting worker will take EVAL tasks (True when it cannot tell)."""
    try:
        queues = worker.app.amqp.queues.consume_from
    except AttributeError:
        return True
    return not queues or any(q == "eval" or str(q).startswith("eval.") for q in queues)


@worker_init.connect
def warm_handlers(sender: Any = None, **_: Any) -> None:
    """Load what grading needs once, before the pool forks, on workers that grade."""
    if not consumes_eval(sender):
        return
    for name in known_handlers():
        try:
            get_handler(name).warm_up()
        except Exception:
            log.exception("warming up the %s handler failed; its first job will be slower", name)


def reap_forever(interval: float) -> None:
    """Every `interval` seconds, stop this host's sandboxes whose job ended or lease expired."""
    while True:
        time.sleep(interval)
        try:
            rt = get_runtime()
            reaped = reap(rt.settings.sandbox_dir.resolve(), partial(holds_box_here, rt))
            if reaped:
                log.info("reaped sandboxes %s", ", ".join(reaped))
            publish_sandbox_limits(rt)
        except Exception:
            log.exception("sandbox reaper sweep failed; trying again in %.0fs", interval)


def holds_box_here(rt: Runtime, job_id: str) -> bool:
    """Whether the job may still hold a box on this node: it is live, and its record names no
    sandbox on another node (a job restarted elsewhere after this node was lost)."""
    try:
        record = rt.store.get(job_id, task=False)
    except JobNotFound:
        return False
    if record.status.terminal:
        return False
    return record.sandbox is None or record.sandbox.get("host") == rt.settings.node_name


def publish_sandbox_limits(rt: Runtime) -> None:
    """Tell the gateway which box-wide limits this node's sandboxes get (`workers.boxreport`)."""
    settings = rt.settings
    report = boxreport.node_report(settings.sandbox_backend)
    boxreport.publish(rt.store.r, settings.key_prefix, settings.node_name, report)


@worker_ready.connect
def report_sandbox_limits(**_: Any) -> None:
    """Say once, when the worker starts, which box-wide limits its sandboxes get."""
    try:
        rt = get_runtime()
        report = boxreport.node_report(rt.settings.sandbox_backend)
        log.info("sandbox limits on this node: %s", boxreport.describe(report))
        publish_sandbox_limits(rt)
    except Exception:
        log.exception("cannot tell which sandbox limits this node enforces")


@worker_ready.connect
def start_reaper(**_: Any) -> None:
    """Each worker sweeps its host for leaked sandboxes (a crashed worker's, a cancelled job's)."""
    interval = get_runtime().settings.reap_interval
    threading.Thread(target=reap_forever, args=(interval,), name="reaper", daemon=True).start()


def watch_backends_forever(interval: float) -> None:
    """Every `interval` seconds, one worker of the fleet probes the backends and reconciles
    the pool's counts (a Redis lock picks which)."""
    owner = f"{socket.gethostname()}:{os.getpid()}"
    while True:
        time.sleep(interval)
        try:
            rt = get_runtime()
            lock = f"{rt.settings.key_prefix}pool:sweep-lock"
            if take_turn(rt.pool.client, lock, owner, interval):
                sweep(rt.pool, rt.store.live, started_of=engine_started)
        except Exception:
            log.exception("backend health sweep failed; trying again in %.0fs", interval)


@worker_ready.connect
def start_backend_watch(**_: Any) -> None:
    """Each worker takes its turn at the backend health checks."""
    interval = get_runtime().settings.health_interval
    threading.Thread(
        target=watch_backends_forever, args=(interval,), name="backend-health", daemon=True
    ).start()


@worker_init.connect
def register_worker(sender: Any = None, **_: Any) -> None:
    """Fix this worker's identity and beat once, before the pool forks (`workers.liveness`)."""
    try:
        liveness.register(liveness.consumed_queues(sender))
    except Exception:
        log.exception("the first worker heartbeat failed; the heartbeat thread retries")


@worker_ready.connect
def start_heartbeat_and_sweeper(**_: Any) -> None:
    """Each worker beats, and takes its turn at sweeping for lost and overdue stages."""
    settings = get_runtime().settings
    threading.Thread(target=liveness.beat_forever, name="heartbeat", daemon=True).start()
    threading.Thread(
        target=sweep_forever, args=(settings.sweep_interval,), name="sweeper", daemon=True
    ).start()


@shared_task(name="rollserve.init", bind=True)
def init_task(self: Task, job_id: str, attempt: int = 0) -> None:
    tracked(self, job_id, partial(execute_stage, self, "init", job_id, stages.init_stage), attempt)


@shared_task(name="rollserve.run", bind=True)
def run_task(self: Task, job_id: str, attempt: int = 0) -> None:
    tracked(self, job_id, partial(execute_stage, self, "run", job_id, stages.run_stage), attempt)


@shared_task(name="rollserve.eval", bind=True)
def eval_task(self: Task, job_id: str, attempt: int = 0) -> None:
    tracked(self, job_id, partial(execute_stage, self, "eval", job_id, stages.eval_stage), attempt)
