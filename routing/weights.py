"""Loading new weights into a running inference server, in each engine's own way.

- SGLang (`kind` `sglang`): `POST /update_weights_from_disk {"model_path", "flush_cache": true}`
  (SGLang waits for the requests in flight, loads, empties its radix cache), answered
  `{"success", "message", "num_paused_requests"}`.
- vLLM (`kind` `vllm`; the development server registers as one and serves the same routes):
  its development-mode endpoints, served only when vLLM runs with `VLLM_SERVER_DEV_MODE=1`,
  and rollserve's worker extension (`deploy/vllm_plugins/rollserve_vllm_worker.py`, loaded
  with `--worker-extension-cls`); `deploy.engine` starts rollserve's vLLM servers with both:
  1. `POST /pause?mode=wait` — new requests wait, those in flight finish with the old weights,
     the prefix cache is emptied;
  2. `POST /collective_rpc {"method": "rollserve_load_weights", "args": [DIR]}` — the worker
     refuses a checkpoint whose config differs from the served model's (vLLM's own
     `reload_weights` would load it into the running model without a word), then loads it in
     place with vLLM's `reload_weights`, and finishes an output layer tied to the input
     embeddings, which vLLM 0.32's CPU build otherwise leaves computing with the old matrix;
  3. `POST /reset_prefix_cache` — nothing cached before the load is reused (answered
     `{"success": true}`; `false` while blocks are held, retried for a moment);
  4. `POST /resume` — the waiting requests run on the new weights.
  A refused checkpoint resumes the engine on its old weights; a load that failed part-way
  leaves it paused, as nothing says which weights it would serve (a later successful load
  resumes it).

`model_path` is a directory on the inference server's machine, in the served model's
format (for vLLM: what `vllm serve` itself could load; for a trainer, `save_pretrained`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from core.schemas import Backend
from routing.vllm import bearer

LOAD_METHOD = "rollserve_load_weights"
"""The worker method (rollserve's vLLM worker extension) that loads a checkpoint directory."""
WORKER_EXTENSION = "rollserve_vllm_worker.RollserveWorker"
"""How vLLM is told to load that extension (`--worker-extension-cls`)."""
REFUSED = "rollserve_load_weights refused"
"""What the extension's error starts with when it refused before touching the weights."""
NOT_IMPLEMENTED = f"has no attribute '{LOAD_METHOD}'"
"""What vLLM says of a worker method it lacks."""
RESET_ATTEMPTS = 20
"""Times `/reset_prefix_cache` is asked before giving up (it fails while blocks are held)."""
SHOWN = 500
"""Most characters of an engine's answer quoted in an error."""


class WeightUpdateError(RuntimeError):
    """A backend did not take the new weights; the message names it and quotes its engine."""

    def __init__(self, backend: Backend, message: str) -> None:
        self.backend_id = backend.id
        self.message = message
        super().__init__(f"backend {backend.id} ({backend.kind} at {backend.url}): {message}")


def _quote(response: httpx.Response) -> str:
    text = response.text.strip()
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


async def _post(
    http: httpx.AsyncClient, backend: Backend, path: str, *, retry: bool = True, **kwargs: Any
) -> httpx.Response:
    """`POST path`; a `WeightUpdateError` for no answer or an answer other than 200.

    With `retry` (idempotent calls), a connection that breaks is tried once more: vLLM closes
    the connection after answering an error of `/collective_rpc` with a 500."""
    for attempt in (1, 2):
        try:
            response = await http.post(path, **kwargs)
            break
        except httpx.TimeoutException:
            raise WeightUpdateError(backend, f"POST {path} got no answer in time") from None
        except httpx.TransportError as e:
            if retry and attempt == 1:
                continue
            raise WeightUpdateError(
                backend, f"POST {path} failed: {type(e).__name__}: {e}"
            ) from None
    if response.status_code == 404 and backend.kind == "vllm":
        raise WeightUpdateError(
            backend,
            f"POST {path} answered 404: the server does not serve vLLM's development "
            "endpoints (serve it with VLLM_SERVER_DEV_MODE=1)",
        )
    if response.status_code != 200:
        raise WeightUpdateError(
            backend, f"POST {path} answered HTTP {response.status_code}: {_quote(response)}"
        )
    return response


def _json(response: httpx.Response, backend: Backend, path: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise WeightUpdateError(
            backend, f"POST {path} answered something that is not JSON: {_quote(response)}"
        ) from None


async def _load_sglang(
    http: httpx.AsyncClient, backend: Backend, model_path: str, weight_version: str | None
) -> None:
    path = "/update_weights_from_disk"
    body: dict[str, Any] = {"model_path": model_path, "flush_cache": True}
    if weight_version is not None:
        body["weight_version"] = weight_version
    try:
        response = await http.post(path, json=body)
    except httpx.TimeoutException:
        raise WeightUpdateError(backend, f"POST {path} got no answer in time") from None
    except httpx.HTTPError as e:
        raise WeightUpdateError(backend, f"POST {path} failed: {type(e).__name__}: {e}") from None
    answer = _json(response, backend, path) if response.status_code in (200, 400) else None
    if isinstance(answer, dict) and answer.get("success") is True and response.status_code == 200:
        return
    if isinstance(answer, dict) and "message" in answer:
        raise WeightUpdateError(backend, f"SGLang refused the weights: {answer['message']}")
    raise WeightUpdateError(
        backend, f"POST {path} answered HTTP {response.status_code}: {_quote(response)}"
    )


async def _reset_prefix_cache(http: httpx.AsyncClient, backend: Backend) -> None:
    for _ in range(RESET_ATTEMPTS):
        response = await _post(http, backend, "/reset_prefix_cache")
        answer = _json(response, backend, "/reset_prefix_cache")
        if not isinstance(answer, dict) or answer.get("success") is not False:
            return
        await asyncio.sleep(0.1)
    raise WeightUpdateError(
        backend, "POST /reset_prefix_cache kept answering success=false (blocks still held)"
    )


async def _load_vllm(http: httpx.AsyncClient, backend: Backend, model_path: str) -> None:
    await _post(http, backend, "/pause", params={"mode": "wait", "clear_cache": "true"})
    rpc = {"method": LOAD_METHOD, "args": [model_path]}
    try:
        await _post(http, backend, "/collective_rpc", retry=False, json=rpc)
    except WeightUpdateError as e:
        if NOT_IMPLEMENTED in e.message:
            await _post(http, backend, "/resume")
            raise WeightUpdateError(
                backend,
                f"the server lacks rollserve's worker extension (serve it with "
                f"--worker-extension-cls {WORKER_EXTENSION} and deploy/vllm_plugins on its "
                "PYTHONPATH, as `rollserve up --engine vllm` does); the engine said: "
                f"{e.message}",
            ) from None
        if REFUSED in e.message:  # checked before anything was loaded: the old weights serve
            await _post(http, backend, "/resume")
            raise WeightUpdateError(backend, f"the weights were refused: {e.message}") from None
        raise WeightUpdateError(
            backend, f"loading failed (the engine stays paused): {e.message}"
        ) from None
    await _reset_prefix_cache(http, backend)
    await _post(http, backend, "/resume")


async def load_weights(
    backend: Backend, model_path: str, *, timeout: float, weight_version: str | None = None
) -> float:
    """Load the weights in `model_path` (a directory on the server's machine) into the
    running server `backend`; returns the seconds it took.

    Raises `WeightUpdateError` (naming the backend and quoting its engine) when the engine
    refuses, fails or does not finish within `timeout` seconds. `weight_version` is passed
    on to SGLang (its `weight_version`); vLLM keeps none.
    """
    began = time.monotonic()
    try:
        async with (
            asyncio.timeout(timeout),
            httpx.AsyncClient(
                base_url=backend.url,
                timeout=timeout,
                headers=bearer(backend.api_key),
            ) as http,
        ):
            if backend.kind == "sglang":
                await _load_sglang(http, backend, model_path, weight_version)
            elif backend.kind == "vllm":
                await _load_vllm(http, backend, model_path)
            else:
                raise WeightUpdateError(backend, f"unknown backend kind {backend.kind!r}")
    except TimeoutError:
        raise WeightUpdateError(
            backend, f"the weights were not loaded within {timeout:g} s"
        ) from None
    return time.monotonic() - began
