"""The three stages as plain functions of (runtime, job id); each returns whether the job goes on.

They are written to be run twice: a redelivered stage redoes its work, and only the first
final result is recorded (the job store's `finish` is exactly-once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from broker.jobstore import JobRecord
from core.schemas import (
    MAX_STALE_RERUNS,
    TERMINAL_STATUSES,
    Compaction,
    JobStatus,
    StageError,
    Trajectory,
)
from sandbox.egress import read_events
from sandbox.harnesses import harness_env_bind, harness_env_ready
from sandbox.keeper import is_kept, launch
from sandbox.limits import read_limit_hits
from sandbox.toolclient import AsyncToolClient, ToolClient
from workers.agent import Episode, Limits, run_episode
from workers.freshshell import FreshShell
from workers.handlers.base import Grade, Handler
from workers.handlers.registry import get_handler
from workers.harness.run import HarnessEpisode, HarnessJob, instruction_of, run_harness_episode
from workers.harness.sessions import IDLE, KEY_HASH, SessionJob, run_session_episode
from workers.process_state import Runtime, shares_loop
from workers.resume import Restored, restore
from workers.routed_policy import JobCancelled, RoutedPolicy, StalePolicy
from workers.trajectory import TrajectoryBuilder

log = logging.getLogger(__name__)

SESSION_REWARD = "session_reward"
"""The key of a session's own reward in its trajectory's `outcome`."""


class TimeBudgetSpent(Exception):
    """The job's `agent.max_seconds` was used up before one of its stages began."""


def budget_left(record: JobRecord) -> float | None:
    """Seconds left of the job's time budget (`agent.max_seconds` minus the seconds of the
    stages it finished), or None without a budget."""
    budget = record.agent.get("max_seconds")
    if budget is None:
        return None
    return float(budget) - sum(record.durations.values())


def _enter(rt: Runtime, job_id: str, status: JobStatus) -> JobRecord | None:
    """Move the job into `status`; None when it has ended. INIT and RUN refuse to begin once
    the job's time budget is spent (`TimeBudgetSpent`); EVAL grades what RUN left."""
    record = rt.store.get(job_id)
    if record.status.terminal:
        return None
    left = budget_left(record)
    if left is not None and left <= 0 and status is not JobStatus.eval:
        raise TimeBudgetSpent(
            f"the job's time budget of {float(record.agent['max_seconds']):g}s "
            f"(agent.max_seconds) was spent before its {status.value} stage began"
        )
    rt.store.transition(job_id, status, rt.settings.node_name)
    return record


def init_stage(rt: Runtime, job_id: str) -> bool:
    """Prepare the episode: the handler's first messages and tools, kept in the job record,
    and the job's sandbox with its tool server ready, when the handler asks for one."""
    started = time.perf_counter()
    record = _enter(rt, job_id, JobStatus.init)
    if record is None:
        return False
    handler = get_handler(record.data_source)
    context = {
        "messages": handler.initial_messages(record.task),
        "tools": handler.tools(record.task),
    }
    if handler.needs_sandbox:
        start_sandbox(rt, job_id, record, handler)
    rt.store.set_fields(job_id, context=context)
    rt.store.stage_finished(job_id, "init", time.perf_counter() - started)
    return True


def start_sandbox(rt: Runtime, job_id: str, record: JobRecord, handler: Handler) -> None:
    """Start the job's sandbox on this node (a box it had before is stopped first: a
    redelivered INIT, or a stale episode started again) and prepare it for the task."""
    spec = handler.sandbox_spec(record.task, job_id)
    if spec is None:
        return
    if record.agent.get("command"):
        spec.endpoint = True  # the harness's endpoint, bound in
        if harness_env_ready():
            spec.binds.append(harness_env_bind())  # `make harness-env`, read-only
    if record.sandbox is not None:
        rt.release_sandbox(job_id)
    kept = launch(spec, rt.settings.sandbox_backend, rt.settings.sandbox_dir.resolve())
    rt.store.set_fields(job_id, sandbox={**kept.as_dict(), "host": rt.settings.node_name})
    rt.store.pin(job_id, rt.settings.node_name)
    with ToolClient(kept.socket_path, timeout=rt.settings.tool_timeout) as tools:
        handler.prepare(record.task, tools)


def compaction_of(record: JobRecord) -> Compaction | None:
    """The job's `agent.compaction`, if it asked for one."""
    plan = record.agent.get("compaction")
    return None if plan is None else Compaction.model_validate(plan)


def limits_for(record: JobRecord, tool_timeout: float = 120.0) -> Limits:
    """The episode's bounds from the job's resolved sampling and agent parameters; its
    deadline is what is left of the job's time budget, counted from now."""
    sampling: dict[str, Any] = record.sampling
    seed = sampling.get("seed")
    left = budget_left(record)
    return Limits(
        max_turns=int(record.agent["max_turns"]),
        max_total_tokens=int(record.agent["max_total_tokens"]),
        max_tokens=int(sampling["max_tokens"]),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        seed=None if seed is None else int(seed) + record.sample_index,
        stop=sampling.get("stop"),
        tool_timeout=tool_timeout,
        deadline=None if left is None else time.monotonic() + max(0.0, left),
    )


def run_stage(rt: Runtime, job_id: str) -> bool:
    """Run the agent loop, each request routed through the backend pool, saving the trajectory
    after every turn. A job cancelled meanwhile stops within one turn (its in-flight request
    is aborted) and gives back its backend and sandbox. A job whose turns went stale
    (`agent.max_staleness`) starts its episode again, or is dropped (`agent.on_stale`)."""
    started = time.perf_counter()
    record = _enter(rt, job_id, JobStatus.run)
    if record is None:
        return False
    if record.context is None:
        raise RuntimeError("the job reached RUN without the context INIT prepares")
    handler = get_handler(record.data_source)
    limits = limits_for(record, rt.settings.tool_timeout)
    saved, record = _saved_episode(rt, job_id, record, handler)
    reruns = 0
    while True:
        attempt = _run_episode(rt, job_id, record, handler, limits, reruns, saved)
        saved = None
        if isinstance(attempt, StalePolicy):
            if record.agent.get("on_stale") == "drop" or reruns >= MAX_STALE_RERUNS:
                why = str(attempt) + (f" (after {reruns} reruns)" if reruns else "")
                error = StageError(stage="run", type="stale_policy", message=why)
                rt.end_job(job_id, JobStatus.failed, error)
                return False
            reruns += 1
            log.info("job %s is stale (%s): its episode starts again", job_id, attempt)
            if record.sandbox is not None:
                start_sandbox(rt, job_id, record, handler)
                record = rt.store.get(job_id)
            continue
        if attempt is None:
            return False
        episode, trajectory = attempt
        break
    trajectory.stop_reason = episode.stop_reason
    trajectory.truncated = episode.truncated
    if record.sandbox is not None:
        # The agent's turns are over: nothing it started runs on, and what it produced is
        # read by fresh processes (workers.freshshell), not through its tool server.
        shell = FreshShell(record.sandbox)
        shell.halt()
        trajectory.outcome = handler.collect_outcome(record.task, shell)
        trajectory.egress = read_events(Path(record.sandbox["state_dir"]))
        trajectory.limits = read_limit_hits(Path(record.sandbox["state_dir"]))
        if not handler.grades_in_sandbox:
            rt.release_sandbox(job_id)  # EVAL does not need it, and may run on another host
    if isinstance(episode, HarnessEpisode):
        # Only a session's caller gives this reward: whatever the box's outcome said is dropped.
        trajectory.outcome.pop(SESSION_REWARD, None)
        if episode.reward is not None:
            trajectory.outcome[SESSION_REWARD] = episode.reward
    rt.store.save_partial(job_id, trajectory)
    rt.store.stage_finished(job_id, "run", time.perf_counter() - started)
    return True


def _saved_episode(
    rt: Runtime, job_id: str, record: JobRecord, handler: Handler
) -> tuple[Trajectory | None, JobRecord]:
    """What an earlier worker saved of the job's episode, to go on with (`workers.resume`),
    and the job's record: only for a RUN taken over (the job's attempt counts takeovers) of
    the built-in loop, when the box those turns ran in (if any) still runs here. A box found
    gone is replaced by a fresh one, where the episode starts again."""
    if record.attempt == 0 or record.agent.get(KEY_HASH) or record.agent.get("command"):
        return None, record
    stored = rt.store.stored_trajectory(job_id)
    if stored is None or not stored.turns:
        return None, record
    box = record.sandbox
    if box is not None and box.get("host") != rt.settings.node_name:
        return None, record
    if box is not None and not is_kept(box):
        log.info("job %s: its box is gone; the episode starts again in a fresh one", job_id)
        start_sandbox(rt, job_id, record, handler)  # what was saved in the old one is dropped
        return None, rt.store.get(job_id)
    return stored, record


def _run_episode(
    rt: Runtime,
    job_id: str,
    record: JobRecord,
    handler: Handler,
    limits: Limits,
    reruns: int,
    saved: Trajectory | None = None,
) -> tuple[Episode, Trajectory] | StalePolicy | None:
    """One start of the job's episode (from the `saved` turns of an earlier worker, when it
    can go on from them): the episode and its trajectory; the `StalePolicy` that stopped it;
    or None when the job was ended from outside (its box given back)."""
    routed = RoutedPolicy(
        rt.pool,
        job_id,
        rt.policy,
        is_live=rt.live_check(job_id),
        job_key=rt.store.job_key(job_id),
        final=[status.value for status in TERMINAL_STATUSES],
        backend_wait=rt.settings.backend_wait,
        failovers=rt.settings.backend_failovers,
        max_staleness=record.agent.get("max_staleness"),
        offload=shares_loop(),
    )
    trajectory = rt.store.skeleton(record)
    trajectory.status = JobStatus.run
    trajectory.stale_reruns = reruns
    restored: Restored | None = None
    if saved is not None and record.context is not None:
        restored = restore(
            saved, record.context["messages"], record.context.get("tools"), record.attempt
        )
    if restored is not None:
        trajectory.stale_reruns = saved.stale_reruns if saved is not None else reruns
        trajectory.resumes = [*restored.stored.resumes, restored.resume]
        log.info(
            "job %s goes on from its turn %d (%d saved turn(s) dropped, %d ids to prefill again)",
            job_id,
            restored.resume.turn,
            restored.resume.dropped_turns,
            restored.resume.reprefill_ids,
        )

    def save(builder: TrajectoryBuilder) -> Awaitable[bool]:
        """The trajectory so far, written on a thread (already started: the loop goes on,
        the agent awaits it before the next save). The record is serialised there from
        `trajectory`, which nothing changes until then."""
        builder.fill(trajectory)
        _stamp_backend(trajectory, routed)
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, rt.store.save_partial, job_id, trajectory)

    if record.agent.get(KEY_HASH):
        work = _session_episode(rt, record, routed, limits, save)
    elif record.agent.get("command"):
        work = _harness_episode(rt, record, routed, limits, save)
    else:
        work = _episode_with_tools(record, handler, routed, limits, save, restored)
    try:
        episode = rt.run(work, job_id=job_id, time_limit=rt.settings.run_soft_time_limit)
        routed.check_staleness()  # the bound holds until the episode's end, not only per turn
    except JobCancelled:
        rt.release_sandbox(job_id)
        return None
    except StalePolicy as exc:
        return exc
    finally:
        rt.pool.release(job_id)
    episode.builder.fill(trajectory)
    if isinstance(episode, HarnessEpisode):
        trajectory.harness = episode.harness
    _stamp_backend(trajectory, routed)
    rt.store.set_fields(
        job_id, backend_id=trajectory.backend_id, policy_version=trajectory.policy_version
    )
    return episode, trajectory


def _stamp_backend(trajectory: Trajectory, routed: RoutedPolicy) -> None:
    """The trajectory's backend is the latest one; its policy version is the first turn's
    (the oldest weights in it: every turn carries its own)."""
    if routed.backend is not None:
        trajectory.backend_id = routed.backend.id
    versions = [t.policy_version for t in trajectory.turns if t.type == "model"]
    trajectory.policy_version = versions[0] if versions else None


async def _episode_with_tools(
    record: JobRecord,
    handler: Handler,
    routed: RoutedPolicy,
    limits: Limits,
    save: Callable[[TrajectoryBuilder], Awaitable[object] | None],
    restored: Restored | None = None,
) -> Episode:
    assert record.context is not None
    runner = None
    if record.sandbox is not None:
        runner = AsyncToolClient(record.sandbox["socket_path"], timeout=limits.tool_timeout + 30)
    try:
        return await run_episode(
            handler,
            record.task,
            record.context["messages"],
            record.context.get("tools"),
            routed,
            routed,
            limits,
            on_turn=save,
            runner=runner,
            restored=restored,
            compaction=compaction_of(record),
        )
    finally:
        if runner is not None:
            await runner.close()


async def _harness_episode(
    rt: Runtime,
    record: JobRecord,
    routed: RoutedPolicy,
    limits: Limits,
    save: Callable[[TrajectoryBuilder], Awaitable[object] | None],
) -> Episode:
    assert record.context is not None
    if record.sandbox is None:
        raise RuntimeError("a job with agent.command reached RUN without its sandbox")
    job = HarnessJob(
        job_id=record.job_id,
        command=str(record.agent["command"]),
        instruction=instruction_of(record.context["messages"]),
        sandbox=record.sandbox,
        model=_model_name(rt),
        port=rt.settings.harness_port,
        parser=rt.settings.harness_tool_parser,
    )
    return await run_harness_episode(
        job,
        routed,
        limits,
        is_live=routed.is_live,
        on_turn=save,
        time_limit=rt.settings.run_soft_time_limit,
    )


async def _session_episode(
    rt: Runtime,
    record: JobRecord,
    routed: RoutedPolicy,
    limits: Limits,
    save: Callable[[TrajectoryBuilder], Awaitable[object] | None],
) -> Episode:
    assert record.context is not None
    job = SessionJob(
        job_id=record.job_id,
        key_sha256=str(record.agent[KEY_HASH]),
        idle_seconds=float(record.agent.get(IDLE, 600.0)),
        model=_model_name(rt),
        parser=rt.settings.harness_tool_parser,
        tools=record.context.get("tools") if record.sandbox is not None else None,
        socket_path=record.sandbox["socket_path"] if record.sandbox is not None else None,
        tool_timeout=limits.tool_timeout,
    )

    async def publish(url: str | None) -> None:
        await asyncio.to_thread(rt.store.set_fields, record.job_id, session_url=url)

    return await run_session_episode(
        job,
        routed,
        limits,
        host=rt.settings.session_host,
        publish=publish,
        is_live=routed.is_live,
        on_turn=save,
        time_limit=rt.settings.run_soft_time_limit,
    )


def _model_name(rt: Runtime) -> str:
    """The served model's name, as a harness's endpoint lists it."""
    backends = rt.pool.list()
    return backends[0].model if backends else "policy"


def eval_stage(rt: Runtime, job_id: str) -> bool:
    """Grade the episode and record the job as completed (once)."""
    started = time.perf_counter()
    record = _enter(rt, job_id, JobStatus.eval)
    if record is None:
        return False
    handler = get_handler(record.data_source)
    trajectory = rt.store.trajectory(job_id)
    texts = [turn.text for turn in trajectory.turns if turn.type == "model"]
    if record.agent.get(KEY_HASH) and SESSION_REWARD in trajectory.outcome:
        # The session's caller gave its own reward at its end.
        if record.sandbox is not None:
            rt.release_sandbox(job_id)
        grade = Grade(float(trajectory.outcome[SESSION_REWARD]), {"source": "session"})
    elif record.sandbox is not None and handler.grades_in_sandbox:
        try:
            shell = FreshShell(record.sandbox)
            grade = handler.grade(record.task, texts, shell, trajectory.outcome, job_id=job_id)
        finally:
            rt.release_sandbox(job_id)
    else:
        grade = handler.grade(record.task, texts, outcome=trajectory.outcome, job_id=job_id)
    trajectory.reward = float(grade.reward)
    trajectory.eval = grade.details
    rt.store.stage_finished(job_id, "eval", time.perf_counter() - started)
    rt.finish(job_id, JobStatus.completed, trajectory)
    return False
