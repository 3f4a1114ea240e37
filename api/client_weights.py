"""`update_weights` of the Python clients (`api.client`): after an optimizer step, switch the
inference fleet to the new weights in one call.

    report = client.update_weights("/shared/ckpt/step-13", policy_version=13)
    for backend in report.backends:     # each: ok, error, drain/load/total seconds
        ...

The gateway drains every backend (or those named), waits until no job holds it, loads the
checkpoint directory and resumes it announcing `policy_version`; see
`POST /v1/backends/update_weights`. The report says which backends switched; the call raises
`RolloutServiceError` when none did (502), for an unknown backend id (404) or when no backend is
registered (409).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from core.schemas import WeightUpdateReport

PATH = "/v1/backends/update_weights"


def _call(
    model_path: str, policy_version: int, backends: Sequence[str] | None, timeout: float
) -> dict[str, Any]:
    """The request's body, and a read timeout covering the gateway's two waits of up to
    `timeout` each (until idle, then until loaded)."""
    body: dict[str, Any] = {
        "model_path": model_path,
        "policy_version": policy_version,
        "timeout": float(timeout),
    }
    if backends is not None:
        body["backends"] = list(backends)
    return {"json": body, "read": 2 * float(timeout) + 60.0}


def _report(response: httpx.Response) -> WeightUpdateReport:
    from api.client import _parse  # the client imports this module

    return _parse(WeightUpdateReport, response)


class WeightUpdates:
    """`update_weights` of `api.client.RolloutClient`."""

    timeout: float
    _request: Callable[..., httpx.Response]

    def update_weights(
        self,
        model_path: str,
        policy_version: int,
        backends: Sequence[str] | None = None,
        timeout: float = 600.0,
    ) -> WeightUpdateReport:
        """``POST /v1/backends/update_weights``: every backend (or those named by id) is
        drained, loads the checkpoint directory ``model_path`` (a path on the inference
        servers' machines) and resumes announcing ``policy_version``. Returns the report
        (per backend: ``ok``, ``error``, ``drain_seconds``, ``load_seconds``,
        ``total_seconds``); a backend that failed stays drained. ``timeout`` bounds each wait
        (until idle, then until loaded) per backend."""
        kw = _call(model_path, policy_version, backends, timeout)
        timeouts = httpx.Timeout(self.timeout, read=kw.pop("read"))
        response = self._request("POST", PATH, timeout=timeouts, **kw)
        return _report(response)


class AsyncWeightUpdates:
    """`update_weights` of `api.client.AsyncRolloutClient`."""

    timeout: float
    _request: Callable[..., Awaitable[httpx.Response]]

    async def update_weights(
        self,
        model_path: str,
        policy_version: int,
        backends: Sequence[str] | None = None,
        timeout: float = 600.0,
    ) -> WeightUpdateReport:
        """``POST /v1/backends/update_weights``; see `WeightUpdates.update_weights`."""
        kw = _call(model_path, policy_version, backends, timeout)
        timeouts = httpx.Timeout(self.timeout, read=kw.pop("read"))
        response = await self._request("POST", PATH, timeout=timeouts, **kw)
        return _report(response)
