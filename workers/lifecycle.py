"""A stage task's life as the job store sees it, so that a cancelled job's stop is confirmed.

Every stage task runs between `stage_begin` (refused once the job has ended: a cancel and a
starting stage cannot both go on) and `stage_end`. A cancel of a job whose stage is running,
or whose sandbox is up, puts the job in its batch's stopping set; it leaves the set — and the
batch can be done — once the stage has ended and the sandbox has been released:

- the stage returns (the run stage notices the cancel within one turn, the others are short)
  and `tracked` frees the job's backend slot and sandbox, then clears the stage mark;
- the stage was killed by `revoke(terminate=True)`: billiard turns the SIGTERM into a
  SystemExit, so `tracked`'s `finally` still frees and clears; and the worker's main process
  gets `task_revoked`, waits until the stage has unwound (or its process is gone, e.g. after
  a SIGKILL), frees the slot and the sandbox (also one the killed INIT had started but not
  yet recorded) and clears the mark;
- a queued stage task of the job is dropped on receipt (`task_revoked` too): same release;
- the sandbox lives on another node than the canceller: the canceller broadcasts
  `rollserve_release` and that node's workers stop it.

Each step records what it freed in the job store (`stage_end`, `sandbox_released`), whose
Lua script drops the job from the stopping set once nothing of it is left.

The marks also say which worker holds a stage (`workers.liveness`): `on_received` notes a
stage message as soon as the worker's main process receives it, `tracked` marks it when it
begins, and the sweeper (`workers.sweeper`) takes over the stages of a worker whose
heartbeat stopped. A stage message of an earlier attempt than the job's is dropped.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.signals import task_received, task_revoked
from celery.worker.control import control_command

from broker.jobstore import JobNotFound, job_of_task
from core.schemas import JobStatus
from sandbox.procs import process_matches, process_start_time
from sandbox.reaper import reap
from workers.dispatch import RELEASE_COMMAND
from workers.holdings import free
from workers.liveness import owner
from workers.process_state import Runtime, get_runtime

log = logging.getLogger(__name__)

STAGE_TASKS = frozenset({"rollserve.init", "rollserve.run", "rollserve.eval"})
KILL_WAIT = 10.0
"""Seconds to wait for a terminated stage to stop before confirming anyway."""


def where(rt: Runtime) -> str:
    """`node|pid|start time` of this process, as a stage mark records it."""
    pid = os.getpid()
    return f"{rt.settings.node_name}|{pid}|{process_start_time(pid) or ''}"


def tracked(task: Task, job_id: str, body: Callable[[], None], attempt: int = 0) -> None:
    """Run a stage task's `body` between the job store's stage marks (see the module doc).

    The mark names this worker (`workers.liveness.owner`) so the sweeper can take the stage
    over if the worker dies; a message of an earlier `attempt` than the job's (the stage was
    taken over and sent again) is dropped without touching the job.
    """
    rt = get_runtime()
    task_id = str(task.request.id or "")
    try:
        began = rt.store.begin_stage(job_id, task_id, where(rt), owner(rt), attempt)
    except JobNotFound:
        log.warning("job %s is not in the store (expired or deleted); dropping it", job_id)
        task.request.chain = None
        return
    if began == "stale":
        log.info("job %s: dropping %s of attempt %d, sent again since", job_id, task_id, attempt)
        task.request.chain = None
        return
    if began == "ended":  # ended (cancelled) before this stage could start: nothing may stay
        task.request.chain = None
        rt.free(job_id, task_id)  # also a mark left by a worker that died running it
        return
    try:
        body()
    finally:
        try:
            if rt.store.status(job_id) is JobStatus.cancelled:  # other ends free their own
                rt.free(job_id, task_id)
            else:
                rt.store.stage_end(job_id, task_id)
        except Exception:
            log.exception("ending the stage mark of job %s failed", job_id)


def job_of_request(request: Any) -> str | None:
    """The job id of a stage task's request (its argument, or its task id)."""
    args = getattr(request, "args", None)
    if isinstance(args, list | tuple) and args and isinstance(args[0], str):
        return args[0]
    task_id = getattr(request, "id", None)
    return job_of_task(task_id) if isinstance(task_id, str) else None


def wait_stopped(rt: Runtime, job_id: str, task_id: str, mark: str) -> None:
    """Wait until a killed stage task has stopped: its own `finally` cleared its mark while the
    SIGTERM unwound it (billiard turns SIGTERM into SystemExit), or its process is gone."""
    host, _, rest = mark.partition("|")
    pid_text, _, start_text = rest.partition("|")
    ours = host == rt.settings.node_name and pid_text.isdigit()
    pid = int(pid_text) if ours else None
    start = int(start_text) if start_text.isdigit() else None
    deadline = time.monotonic() + KILL_WAIT
    while time.monotonic() < deadline:
        if ours and not process_matches(pid, start):
            return
        active = rt.store.active_stage(job_id)
        if active is None or active[0] != task_id:
            return
        time.sleep(0.01)
    log.warning("job %s: task %s did not stop within %.0fs", job_id, task_id, KILL_WAIT)


def on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    """In the worker's main process: a stage task of an ended job was killed, or dropped on
    receipt. Confirm the job stopped once what it held here is freed."""
    name = getattr(sender, "name", None)
    if name is not None and name not in STAGE_TASKS:
        return
    job_id = job_of_request(request)
    task_id = str(getattr(request, "id", "") or "")
    if not job_id:
        return
    started = time.monotonic()
    try:
        rt = get_runtime()
        if terminated and rt.runs_many:
            # The stage runs on a thread of this process, and terminating it cancelled its
            # episode (`workers.jobpool`): it unwinds within moments and `tracked` frees what
            # it holds, as for any cancelled stage. Nothing to wait for here.
            return
        active = rt.store.active_stage(job_id)
        if terminated and active is not None and active[0] == task_id:
            wait_stopped(rt, job_id, task_id, active[1])
        if not rt.job_live(job_id):
            if terminated and task_id.endswith("-init"):
                # a box the killed INIT launched but had not recorded yet
                state_root = rt.settings.sandbox_dir.resolve()
                reap(state_root, lambda other: other != job_id)
            rt.free(job_id, task_id)
        else:
            rt.store.stage_end(job_id, task_id)
        log.info(
            "job %s: %s task %s stopped, freed in %.3fs",
            job_id,
            "terminated" if terminated else "revoked",
            task_id,
            time.monotonic() - started,
        )
    except JobNotFound:
        return
    except Exception:
        log.exception("confirming the stop of job %s (task %s) failed", job_id, task_id)


def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """In the worker's main process: a stage message arrived. Note in the job store that this
    worker holds it before any pool process begins it, so the sweeper takes it over if the
    worker dies while the message waits here (`JobStore.reserve`)."""
    if getattr(request, "name", None) not in STAGE_TASKS:
        return
    job_id = job_of_request(request)
    args = getattr(request, "args", None)
    attempt = args[1] if isinstance(args, list | tuple) and len(args) > 1 else 0
    if not job_id or not isinstance(attempt, int):
        return
    try:
        rt = get_runtime()
        rt.store.reserve(job_id, str(getattr(request, "id", "") or ""), owner(rt), attempt)
    except Exception:
        log.exception("noting the receipt of job %s's stage failed", job_id)


def rollserve_release(state: Any, job_ids: list[str]) -> dict[str, str]:
    """Stop the sandboxes on this node of these ended jobs (asked by a canceller elsewhere)."""
    rt = get_runtime()
    ended = [job_id for job_id in job_ids if not rt.job_live(job_id)]
    freed = free(rt.store, rt.pool, rt.settings.node_name, ended, slot=False)
    return {"ok": f"released {len(freed.here)} sandbox(es)"}


def connect_worker_hooks() -> None:
    """Hook this module into the worker: `on_revoked` on Celery's `task_revoked` signal and
    `on_received` on `task_received` (in the main process), `rollserve_release` as the
    remote-control command of that name. Called
    once by the module that defines the stage tasks; connecting twice changes nothing."""
    task_revoked.connect(on_revoked, weak=False, dispatch_uid="rollserve.on_revoked")
    task_received.connect(on_received, weak=False, dispatch_uid="rollserve.on_received")
    control_command(name=RELEASE_COMMAND, args=[("job_ids", list)], signature="<job id> ...")(
        rollserve_release
    )
