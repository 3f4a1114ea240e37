"""The sweeper: stages whose worker died, stages past their limits, jobs of a dead node.

Every worker runs it every `ROLLSERVE_SWEEP_INTERVAL` seconds; a Redis lock lets one worker
of the fleet act per interval, and every takeover is one Lua script that succeeds once
(`JobStore.claim`), so two sweepers racing never send a stage twice. One pass:

- a held stage — begun, or only received by a worker whose pool had no process free yet —
  whose worker's heartbeat is gone (and that has been held longer than the heartbeat's time
  to live) is taken over: the job's attempt goes up, and the stage is sent
  again with the rest of its chain — to its shared queue, or to `run.<node>`/`eval.<node>`
  when the job's sandbox lives on a node that still has a worker for that stage. When it
  has none, the job starts again from INIT on any node; its box on the lost node is left to
  that node's reaper. The lost attempt's message, when Celery redelivers it after the
  visibility timeout, carries the earlier attempt and is dropped (`JobStore.begin_stage`).
  A job that lost `ROLLSERVE_MAX_ATTEMPTS` attempts fails (`worker_lost`);
- a stage held past its hard time limit (its process was killed without a word to the job
  store) ends its job `timed_out`, and so does an INIT or RUN that has used up the job's
  `agent.max_seconds` (RUN stops by itself at the budget; this catches one that cannot);
- a job whose sandbox lives on a node with no live worker for its next pinned stage, and no
  stage of which is held, starts again from INIT;
- a stage message a worker fetched from Redis but never noted (it died in between), older
  than the heartbeat's time to live, is taken over the same way;
- a live job that holds no stage and has waited longer than the heartbeat's time to live for
  its next stage's message (`JobStore.in_transit`: just created, or a stage just ended), when
  that message is neither in a queue nor fetched by a worker at two looks in a row, gets the
  stage sent again the same way: a worker killed after Redis handed it the message and before
  it was noted as fetched lost it, or a sender died before publishing it;
- an ended job still marked by a dead worker's stage gets its mark cleared, so its cancel
  is confirmed.

Each case frees what the job holds (`workers.holdings.free`, through the dispatcher).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

from broker.celery_app import QUEUES, find_messages, node_queue, unacked_stages
from broker.jobstore import Holding
from core.schemas import JobStatus, StageError
from routing.health import take_turn
from workers.handlers.registry import get_handler
from workers.liveness import owner, process_id, steady
from workers.process_state import Runtime, get_runtime

log = logging.getLogger(__name__)


@dataclass
class Action:
    """What a sweep did to one job (for logs and tests)."""

    job_id: str
    what: str
    """`requeued`, `restarted`, `failed`, `timed_out` or `released`."""
    stage: str
    attempt: int = 0


def sweep(rt: Runtime, now: float | None = None) -> list[Action]:
    """One pass over held stages and pinned jobs (see the module doc); safe to run anywhere,
    any number of times at once."""
    now = time.time() if now is None else now
    actions: list[Action] = []
    held = rt.store.held()
    holdings = rt.store.holdings(held)
    alive: dict[str, bool] = {}
    for job_id in held:
        h = holdings.get(job_id)
        if h is None or not h.task_id:
            rt.store.forget_held(job_id)
            continue
        action = _check_held(rt, h, now, alive)
        if action is not None:
            actions.append(action)
    actions.extend(_check_unnoted(rt, now))
    actions.extend(_check_transit(rt, now))
    for node in rt.store.nodes():
        actions.extend(_check_node(rt, node))
    return actions


def _check_unnoted(rt: Runtime, now: float) -> list[Action]:
    """Take over the stages whose message a worker fetched but never noted: it died between
    taking the message from Redis and receiving it (a live worker notes it at once)."""
    actions: list[Action] = []
    messages = unacked_stages(rt.store.r, now - rt.settings.heartbeat_ttl)
    holdings = rt.store.holdings(sorted({job_id for job_id, _, _ in messages}))
    nobody = rt.store.worker_beat_key("")  # no worker beats under an empty id
    for job_id, stage, attempt in messages:
        h = holdings.get(job_id)
        if h is None or h.status.terminal or h.task_id or h.attempt != attempt:
            continue  # ended, noted by a worker, or an earlier attempt's message
        if stage in h.durations:
            continue  # that stage is done; its message is about to be acknowledged
        action = _take_over(rt, h, stage, nobody)
        if action is not None:
            actions.append(action)
            h.task_id = h.task_ids.get(stage, "")  # one takeover per job and pass
    return actions


TRANSIT_LOOK = 256
"""Jobs in transit looked for per pass (the longest waiting; those found go to the back)."""

NEXT_STAGE = {JobStatus.queued: "init", JobStatus.init: "run", JobStatus.run: "eval"}
"""The stage a live job holding none waits for, by its status (a stage moves its job to the
stage's status when it begins)."""


def _check_transit(rt: Runtime, now: float) -> list[Action]:
    """Send again the stages whose message was lost between stages (see the module doc)."""
    store = rt.store
    ids = store.in_transit(now - rt.settings.heartbeat_ttl, TRANSIT_LOOK)
    if not ids:
        return []
    holdings = store.holdings(ids)
    waiting: dict[str, tuple[Holding, str]] = {}
    settled: list[str] = []
    for job_id in ids:
        h = holdings.get(job_id)
        stage = NEXT_STAGE.get(h.status) if h is not None else None
        if h is None or stage is None or h.task_id or stage not in h.task_ids:
            settled.append(job_id)  # gone, ended, or a stage of it is held again
        else:
            waiting[h.task_ids[stage]] = (h, stage)
    store.forget_transit(settled)
    if not waiting:
        return []
    queues = [*QUEUES] + [node_queue(s, n) for n in store.nodes() for s in ("run", "eval")]
    found = find_messages(store.r, queues, set(waiting))
    store.still_in_transit([waiting[t][0].job_id for t in found], now)
    lost = {h.job_id: (h, stage) for t, (h, stage) in waiting.items() if t not in found}
    earlier = store.missed(list(lost), now)
    actions: list[Action] = []
    nobody = store.worker_beat_key("")  # no worker beats under an empty id
    for job_id in earlier:
        h, stage = lost[job_id]
        log.warning(
            "job %s: the message of its %s stage is in no queue and no worker holds it; "
            "sending it again",
            job_id,
            stage,
        )
        action = _take_over(rt, h, stage, nobody)
        store.forget_transit([job_id])
        if action is not None:
            actions.append(action)
    return actions


def _holder_gone(rt: Runtime, h: Holding, now: float, alive: dict[str, bool]) -> bool:
    """Whether the worker holding the job's stage has stopped (`alive` caches heartbeats for
    one pass)."""
    if now - h.since <= rt.settings.heartbeat_ttl:
        return False
    if h.owner not in alive:
        alive[h.owner] = rt.store.worker_alive(h.owner)
    return not alive[h.owner]


def _check_held(rt: Runtime, h: Holding, now: float, alive: dict[str, bool]) -> Action | None:
    settings = rt.settings
    stage = h.stage or "init"
    if h.status.terminal and h.reserved:
        rt.store.forget_held(h.job_id)
        return None
    if h.status.terminal:
        if not _holder_gone(rt, h, now, alive):
            return None
        rt.dispatcher.free([h.job_id])
        rt.store.stage_end(h.job_id, h.task_id)  # confirms a cancelled job's stop
        return Action(h.job_id, "released", stage, h.attempt)
    if _holder_gone(rt, h, now, alive):
        return _take_over(rt, h, stage, rt.store.worker_beat_key(h.owner))
    if h.pending or h.reserved:
        return None
    elapsed = now - h.since
    hard = float(getattr(settings, f"{stage}_time_limit"))
    # past the heartbeat's time to live too, so a dead worker's stage is taken over instead
    if elapsed > hard + settings.heartbeat_ttl:
        message = f"{stage} ran past its hard limit of {hard:g}s and was stopped"
        return _time_out(rt, h, stage, message)
    budget = h.agent.get("max_seconds")
    grace = settings.heartbeat_ttl + settings.sweep_interval
    if budget is not None and stage != "eval" and h.spent + elapsed > float(budget) + grace:
        message = (
            f"the job's time budget of {float(budget):g}s (agent.max_seconds) ran out in "
            f"{stage} ({h.spent + elapsed:.0f}s spent in its stages)"
        )
        return _time_out(rt, h, stage, message)
    return None


def _check_node(rt: Runtime, node: str) -> list[Action]:
    """Restart the jobs pinned to `node` that wait for a stage no worker there takes now."""
    actions: list[Action] = []
    ids = rt.store.pinned(node)
    holdings = rt.store.holdings(ids)
    for job_id in ids:
        h = holdings.get(job_id)
        if h is None or h.status.terminal or h.sandbox_host != node:
            rt.store.unpin(job_id, node)
            continue
        if h.task_id:
            continue  # a stage of it is held: `_check_held` looks after it
        waiting = "eval" if "run" in h.durations else "run"
        if waiting == "eval" and not get_handler(h.data_source).grades_in_sandbox:
            continue
        if rt.store.node_alive(node, waiting):
            continue
        action = _take_over(rt, h, "init", rt.store.node_beat_key(node, waiting), restart=True)
        if action is not None:
            actions.append(action)
    return actions


def _pinned_stage(h: Holding, stage: str) -> bool:
    """Whether `stage` of the job must run on the node of its sandbox."""
    if h.sandbox_host is None or stage == "init":
        return False
    return stage == "run" or get_handler(h.data_source).grades_in_sandbox


def _take_over(
    rt: Runtime, h: Holding, stage: str, gone: str, *, restart: bool = False
) -> Action | None:
    """Take the job's stage over (once) and send it again, or fail the job past its last
    attempt."""
    node = h.sandbox_host
    if not restart and node is not None and _pinned_stage(h, stage):
        restart = not rt.store.node_alive(node, stage)
    if restart:
        stage = "init"
    send_task = h.task_ids[stage]
    me = owner(rt)
    attempt = rt.store.claim(
        h, gone, send_task, process_id(rt.settings.node_name), me, restart=restart
    )
    if attempt == 0:
        return None  # another sweeper took it, or it moved on meanwhile
    rt.pool.release(h.job_id)  # the lost attempt's backend slot; the next one takes its own
    lost = f"the node {node} holding its sandbox" if restart and node else "its worker"
    if attempt >= rt.settings.max_attempts:
        error = StageError(
            stage=h.stage or stage,
            type="worker_lost",
            message=(
                f"{lost} stopped (no heartbeat for {rt.settings.heartbeat_ttl:g}s) on its "
                f"last of {rt.settings.max_attempts} attempts (ROLLSERVE_MAX_ATTEMPTS)"
            ),
        )
        rt.finish(h.job_id, JobStatus.failed, error=error)
        rt.dispatcher.free([h.job_id])
        rt.store.stage_end(h.job_id, send_task)
        log.warning("job %s failed: %s", h.job_id, error.message)
        return Action(h.job_id, "failed", error.stage, attempt)
    queues: dict[str, str] = {}
    if not restart and node is not None:
        for later in ("run", "eval"):
            if _pinned_stage(h, later):
                queues[later] = f"{later}.{node}"
    rt.dispatcher.send_again(h.job_id, h.task_ids, stage, attempt, queues)
    what = "restarted" if restart else "requeued"
    log.warning(
        "job %s: %s stopped; %s from %s (try %d of %d)",
        h.job_id,
        lost,
        what,
        stage,
        attempt + 1,
        rt.settings.max_attempts,
    )
    return Action(h.job_id, what, stage, attempt)


def _time_out(rt: Runtime, h: Holding, stage: str, message: str) -> Action | None:
    error = StageError(stage=stage, type="timeout", message=message)
    recorded = rt.finish(h.job_id, JobStatus.timed_out, error=error)
    rt.dispatcher.free([h.job_id])
    rt.store.stage_end(h.job_id, h.task_id)
    if not recorded:
        return None
    log.warning("job %s timed out: %s", h.job_id, message)
    return Action(h.job_id, "timed_out", stage, h.attempt)


def sweep_forever(interval: float) -> None:
    """Every `interval` seconds, one worker of the fleet sweeps (a Redis lock picks which)."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    while True:
        time.sleep(interval)
        try:
            rt = get_runtime()
            if not steady(rt.settings.heartbeat_ttl):
                continue  # just started, or Redis was away: let every worker beat first
            if take_turn(rt.store.r, f"{rt.settings.key_prefix}sweep-lock", me, interval):
                sweep(rt)
        except Exception:
            log.exception("the sweep for lost and overdue stages failed; again in %.0fs", interval)
