"""RUN for a job with `agent.command`: its own harness runs in its box, its model calls come
through the job's endpoint, and its exit ends the episode.

The endpoint listens on a Unix socket in the box's endpoint directory (bound read-only into
the box; `sandbox.endpointdir`), where a forwarder inside the box relays
`http://127.0.0.1:<harness_port>` to it. The key is made here, handed only to the harness's
environment and never stored: the endpoint lives as long as this RUN, and a key opens nothing
once it ends. The harness's stdout and stderr are kept, bounded, in the trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.schemas import HARNESS_OUTPUT_LIMIT, HarnessRun
from sandbox.base import ENDPOINT_DIR_INSIDE, ExecResult
from sandbox.endpointdir import endpoint_paths, open_socket
from sandbox.keeper import halt, run_harness
from workers.agent import Episode, Limits
from workers.aio import settle
from workers.harness.server import make_app, serve_unix, stop_server
from workers.harness.session import HarnessSession, RoutedModel
from workers.harness.toolparsers import get_parser
from workers.routed_policy import JobCancelled
from workers.trajectory import TrajectoryBuilder

log = logging.getLogger(__name__)

INSTRUCTION_FILE = "instruction.md"
WATCH_SECONDS = 0.5
"""How often a harness job checks that it is still live while no call of its runs."""


@dataclass
class HarnessEpisode(Episode):
    harness: HarnessRun | None = None
    reward: float | None = None
    """A session's own reward, given at its end (None: the task's grader decides)."""


@dataclass(frozen=True)
class HarnessJob:
    """What RUN knows of the harness job it runs."""

    job_id: str
    command: str
    instruction: str
    sandbox: dict[str, Any]
    """The job's `sandbox` record (the keeper's)."""
    model: str
    port: int
    parser: str


def instruction_of(messages: list[dict[str, Any]]) -> str:
    """The task as a harness reads it: the handler's last user message."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""


async def run_harness_episode(
    job: HarnessJob,
    policy: RoutedModel,
    limits: Limits,
    *,
    is_live: Callable[[], bool] = lambda: True,
    on_turn: Callable[[TrajectoryBuilder], Awaitable[object] | None] = lambda _b: None,
    time_limit: float | None = None,
) -> HarnessEpisode:
    """Run the job's harness to its end and return its episode. Raises what ended the job from
    inside a call (`JobCancelled`, `StalePolicy`), after stopping the harness."""
    session = HarnessSession(
        job.job_id, policy, limits, get_parser(job.parser), model=job.model, on_turn=on_turn
    )
    key = secrets.token_urlsafe(32)

    async def find(given: str) -> HarnessSession | None:
        return session if hmac.compare_digest(given.encode(), key.encode()) else None

    state_dir = Path(str(job.sandbox["state_dir"]))
    paths = endpoint_paths(state_dir)
    paths.directory.joinpath(INSTRUCTION_FILE).write_text(job.instruction)
    # The forwarder in the box sets OPENAI_BASE_URL and ANTHROPIC_BASE_URL to its port.
    env = {"ROLLSERVE_INSTRUCTION_FILE": f"{ENDPOINT_DIR_INSIDE}/{INSTRUCTION_FILE}"}
    runner = await serve_unix(make_app(find), str(paths.socket))
    harness: asyncio.Future[ExecResult] | None = None
    try:
        open_socket(paths, job.sandbox)
        harness = asyncio.ensure_future(
            asyncio.to_thread(
                run_harness,
                job.sandbox,
                ["bash", "-c", job.command],
                env=env,
                api_key=key,
                port=job.port,
                timeout=_timeout(limits, time_limit),
                max_output=HARNESS_OUTPUT_LIMIT,
            )
        )
        await wait_watched(harness, session, is_live)
        result = harness.result()
    except BaseException:
        if harness is not None:
            await _stop(harness, job.sandbox)
        raise
    finally:
        await stop_server(runner)
        await session.flush()
    if session.failure is not None:
        raise session.failure
    return _episode(job, session, result)


def _timeout(limits: Limits, time_limit: float | None) -> float:
    left = limits.time_left()
    bounds = [b for b in (left, time_limit) if b is not None]
    return max(1.0, min(bounds)) if bounds else 24 * 3600.0


async def wait_watched(
    future: asyncio.Future[Any],
    session: HarnessSession,
    is_live: Callable[[], bool],
    timeout: float | None = None,
) -> bool:
    """Wait up to `timeout` seconds (None: no bound) for `future`; whether it is done. Raises
    what ended the job meanwhile: the failure a call met (`session.failed`), or
    `JobCancelled` once the job is no longer live (checked every `WATCH_SECONDS`)."""
    failed: asyncio.Future[Any] = asyncio.ensure_future(session.failed.wait())
    waiting: set[asyncio.Future[Any]] = {future, failed}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not future.done():
            step = WATCH_SECONDS
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return False
            await asyncio.wait(waiting, timeout=step, return_when=asyncio.FIRST_COMPLETED)
            if future.done():
                break
            if failed.done() or not await asyncio.to_thread(is_live):
                if session.failure is None:
                    session.failure = JobCancelled(f"job {session.job_id} is no longer live")
                raise session.failure
        return True
    finally:
        failed.cancel()


async def _stop(harness: asyncio.Future[ExecResult], sandbox: dict[str, Any]) -> None:
    """Kill the harness (the box is halted: everything in it stops, its files stay)."""
    if harness.done():
        return
    with contextlib.suppress(Exception):
        await asyncio.to_thread(halt, sandbox)
    await settle(asyncio.shield(harness), timeout=30)


def _episode(job: HarnessJob, session: HarnessSession, result: ExecResult) -> HarnessEpisode:
    builder = session.builder or TrajectoryBuilder([])
    record = HarnessRun(
        command=job.command,
        exit_code=None if result.timed_out else result.returncode,
        timed_out=result.timed_out,
        killed_by=None if result.timed_out else result.killed_by,
        stdout=result.stdout,
        stderr=result.stderr,
        calls=session.calls,
        refused_calls=session.refused,
    )
    if session.stop_reason is not None:
        reason, truncated = session.stop_reason, True
    elif result.timed_out:
        reason, truncated = "time_budget", True
    else:
        reason, truncated = ("harness_exit" if result.returncode == 0 else "harness_failed"), False
    log.info("job %s: harness ended (%s) after %d calls", job.job_id, reason, session.calls)
    return HarnessEpisode(builder, reason, truncated, harness=record)
