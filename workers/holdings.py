"""What a job holds, and the one function that frees it.

A job may hold three things while it lives: a slot of an inference backend (its sticky
assignment in the pool), a sandbox (a box and its keeper on the node whose INIT started it)
and the mark of its running stage task in the job store. Every path that ends or stops a job
— an end recorded by a stage, a failure or a time-out, a cancel, a stage task revoked or
killed, the release broadcast from another node — and every stage that is done with the job's
box frees them through `free`, so no path forgets one of them.

Each step is safe to repeat: the pool gives a slot back once, a stopped box stays stopped, a
stage mark is cleared only while it is still that task's. What `free` stops is recorded in the
job store (`sandbox_released`, `stage_end`), whose scripts confirm a cancelled job's stop once
nothing of it is left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from broker.jobstore import JobNotFound, JobStore
from routing.pool import BackendPool
from sandbox.keeper import release

log = logging.getLogger(__name__)


@dataclass
class Freed:
    """Whose sandbox `free` stopped here, and whose lives on another node."""

    here: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)


def free(
    store: JobStore,
    pool: BackendPool,
    node: str,
    job_ids: Iterable[str],
    *,
    slot: bool = True,
    sandbox: bool = True,
    task_id: str = "",
    elsewhere: Callable[[list[str]], None] | None = None,
) -> Freed:
    """Free what these jobs hold.

    - `slot`: give back each job's backend slot;
    - `sandbox`: stop each job's sandbox when it lives on `node` (this process's node) and
      record it released; a sandbox on another node is handed to `elsewhere` (the release
      broadcast to that node's workers), or left to that node's reaper without it;
    - `task_id`: clear the stage mark of that task (once it has stopped).

    Returns whose sandbox was stopped here and whose lives on another node. A job whose
    freeing fails (Redis away, a keeper that cannot be reached) does not stop the others: every
    job is tried, and then the first failure is raised (`FreeFailed`, naming the jobs).
    """
    freed = Freed()
    failed: dict[str, Exception] = {}
    for job_id in job_ids:
        try:
            _free_one(store, pool, node, job_id, freed, slot=slot, sandbox=sandbox, task_id=task_id)
        except Exception as exc:
            log.warning("freeing what job %s holds failed: %s", job_id, exc)
            failed[job_id] = exc
    if freed.elsewhere and elsewhere is not None:
        try:
            elsewhere(freed.elsewhere)
        except Exception as exc:
            log.warning(
                "the release of %d sandboxes on other nodes failed: %s", len(freed.elsewhere), exc
            )
            failed.update(dict.fromkeys(freed.elsewhere, exc))
    if failed:
        raise FreeFailed(failed)
    return freed


class FreeFailed(Exception):
    """What some jobs hold could not all be freed; the other jobs were. `failures` maps each
    such job to its error (the first is the cause)."""

    def __init__(self, failures: dict[str, Exception]) -> None:
        self.failures = failures
        first = next(iter(failures.values()))
        super().__init__(f"freeing {len(failures)} job(s) failed ({', '.join(failures)}): {first}")
        self.__cause__ = first


def _free_one(
    store: JobStore,
    pool: BackendPool,
    node: str,
    job_id: str,
    freed: Freed,
    *,
    slot: bool,
    sandbox: bool,
    task_id: str,
) -> None:
    """Every step for one job; each is tried even when an earlier one failed, and the first
    failure is raised after."""
    errors: list[Exception] = []
    if slot:
        try:
            pool.release(job_id)
        except Exception as exc:
            errors.append(exc)
    if sandbox:
        try:
            try:
                kept = store.get(job_id, task=False).sandbox
            except JobNotFound:
                kept = None
            if kept is not None and kept.get("host") == node:
                release(kept)
                store.sandbox_released(job_id)  # a cancelled job's stop waits for this
                freed.here.append(job_id)
            elif kept is not None:
                freed.elsewhere.append(job_id)
        except Exception as exc:
            errors.append(exc)
    if task_id:
        try:
            store.stage_end(job_id, task_id)
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
