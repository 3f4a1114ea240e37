"""Sessions in the Python clients (`api.client`): a job driven by your own harness, in your
own process, through the job's OpenAI- and Anthropic-compatible endpoint.

    session = client.open_session({"data_source": "math", "problem": "...", "answer": "4"})
    llm = openai.OpenAI(base_url=session.openai_base_url, api_key=session.api_key)
    ...                                  # your harness: any number of calls, tools in its box
    traj = client.end_session(session)   # graded by the task (or `reward=0.7`: your own)

`session_tool` runs one of the task's sandbox tools (`session.tools`) in the job's box. The
session's routes carry its key, not the gateway's token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from core.schemas import SessionOpened, Trajectory

POLL_SECONDS = 0.2


def _open_body(request: dict[str, Any], idle_seconds: float | None) -> dict[str, Any]:
    return request if idle_seconds is None else {**request, "idle_seconds": idle_seconds}


def _end_body(reward: float | None) -> dict[str, Any]:
    return {"grade": True} if reward is None else {"reward": float(reward)}


def _key(session: SessionOpened) -> dict[str, str]:
    return {"Authorization": f"Bearer {session.api_key}"}


def _relative(session: SessionOpened, route: str) -> str:
    """The session's route as a path on the gateway."""
    return f"/v1/sessions/{session.job_id}/{route}"


class Sessions:
    """`open_session`, `session_tool` and `end_session` of `api.client.RolloutClient`."""

    _request: Callable[..., httpx.Response]
    get_rollout: Callable[[str], Trajectory]

    def open_session(
        self, request: dict[str, Any], idle_seconds: float | None = None
    ) -> SessionOpened:
        """``POST /v1/sessions``: `request` is `{"task", "sampling"?, "agent"?}` as for a
        rollout; the session ends by itself after `idle_seconds` without a call (600)."""
        from api.client import _parse  # the client imports this module

        response = self._request("POST", "/v1/sessions", json=_open_body(request, idle_seconds))
        return _parse(SessionOpened, response)

    def session_tool(self, session: SessionOpened, name: str, **arguments: Any) -> dict[str, Any]:
        """Run the task's tool `name` in the session's box: `{"result", "text"}`."""
        path = _relative(session, f"tools/{name}")
        answer: dict[str, Any] = self._request(
            "POST", path, json=arguments, headers=_key(session)
        ).json()
        return answer

    def end_session(
        self, session: SessionOpened, reward: float | None = None, timeout: float = 600.0
    ) -> Trajectory:
        """End the session with your own `reward`, or (None) have the task's grader decide;
        returns the finished trajectory (waiting at most `timeout` seconds for the grade)."""
        self._request("POST", _relative(session, "end"), json=_end_body(reward),
                      headers=_key(session))  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            trajectory = self.get_rollout(session.job_id)
            if trajectory.status.terminal or time.monotonic() >= deadline:
                return trajectory
            time.sleep(POLL_SECONDS)


class AsyncSessions:
    """The sessions of `api.client.AsyncRolloutClient`: as `Sessions`, awaited."""

    _request: Callable[..., Awaitable[httpx.Response]]
    get_rollout: Callable[[str], Awaitable[Trajectory]]

    async def open_session(
        self, request: dict[str, Any], idle_seconds: float | None = None
    ) -> SessionOpened:
        from api.client import _parse

        body = _open_body(request, idle_seconds)
        return _parse(SessionOpened, await self._request("POST", "/v1/sessions", json=body))

    async def session_tool(
        self, session: SessionOpened, name: str, **arguments: Any
    ) -> dict[str, Any]:
        path = _relative(session, f"tools/{name}")
        response = await self._request("POST", path, json=arguments, headers=_key(session))
        answer: dict[str, Any] = response.json()
        return answer

    async def end_session(
        self, session: SessionOpened, reward: float | None = None, timeout: float = 600.0
    ) -> Trajectory:
        await self._request("POST", _relative(session, "end"), json=_end_body(reward),
                            headers=_key(session))  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            trajectory = await self.get_rollout(session.job_id)
            if trajectory.status.terminal or time.monotonic() >= deadline:
                return trajectory
            await asyncio.sleep(POLL_SECONDS)
